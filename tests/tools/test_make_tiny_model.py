"""tools/make-tiny-model.py: the tool-using variant's build from the command line."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make-tiny-model.py"


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(TOOL))


def test_variant_tools_builds_into_the_given_folder_and_prints_its_rates(script, tmp_path,
                                                                        capsys):
    code = script["main"](["--variant", "tools", "--out", str(tmp_path / "m"), "--steps", "2"])
    printed = capsys.readouterr()
    assert code == 1  # two steps leave the accuracy far below the band
    assert "band" in printed.err
    assert (tmp_path / "m" / "config.json").is_file()
    assert "greedy: tool-call rate" in printed.out and "without tools" in printed.out
