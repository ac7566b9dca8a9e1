"""``relay.configs.checks``: what the schema alone cannot check, named before a launch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.configs.checks import dump_dir_problem


def test_a_dump_folder_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    assert dump_dir_problem(tmp_path / "new" / "dump") == ""
    assert dump_dir_problem(tmp_path / "a-file") == (
        f"{tmp_path / 'a-file'} exists and is not a folder")
    assert dump_dir_problem(tmp_path / "a-file" / "dump") == (
        f"{tmp_path / 'a-file'} is not a folder, so {tmp_path / 'a-file' / 'dump'} cannot be "
        "created")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_dump_folder_without_write_permission_is_named(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert dump_dir_problem(locked / "dump") == (
        f"{locked / 'dump'} cannot be created: {locked} is not writable by this user")
