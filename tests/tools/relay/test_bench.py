"""relay.bench: ``relay bench NAME`` runs a checkout's ``tools/bench-NAME.py``; an installation
without them says where they come from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relay import bench


def test_the_checkouts_benchmarks_are_found() -> None:
    assert {"e2e", "learner", "transport"} <= set(bench.benchmarks())


def test_a_wheel_install_without_benchmarks_says_so(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "TOOLS_DIR", tmp_path)
    assert bench.main(["e2e"]) == 2
    assert "come with a source checkout" in capsys.readouterr().err


def test_an_unknown_benchmark_is_refused_with_the_list(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark named 'nope'" in err and "e2e" in err


def test_a_benchmark_runs_with_its_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bench-probe.py").write_text(
        "import sys\nprint(sys.argv[1:])\nsys.exit(3)\n")
    monkeypatch.setattr(bench, "TOOLS_DIR", tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the script's folder first
    assert bench.main(["probe", "--steps", "2"]) == 3
    assert capsys.readouterr().out.strip() == "['--steps', '2']"
