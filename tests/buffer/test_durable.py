"""``fsync_dir`` and ``fsync_tree`` sync what they promise: every file's bytes and every
folder's entries, each descriptor closed again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.buffer import durable


def synced_paths(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record the path behind each descriptor ``os.fsync`` is given."""
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    return synced


def test_fsync_dir_syncs_the_folder_and_closes_it(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    synced = synced_paths(monkeypatch)
    open_before = len(os.listdir("/proc/self/fd"))
    durable.fsync_dir(tmp_path)
    assert synced == [tmp_path]
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_fsync_tree_syncs_every_file_and_folder(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dcp" / "shards").mkdir(parents=True)
    files = [tmp_path / "meta.json", tmp_path / "dcp" / "a.distcp",
             tmp_path / "dcp" / "shards" / "b.distcp"]
    for file in files:
        file.write_bytes(b"written")
    synced = synced_paths(monkeypatch)
    durable.fsync_tree(tmp_path)
    assert sorted(synced) == sorted(files + [tmp_path, tmp_path / "dcp",
                                             tmp_path / "dcp" / "shards"])
