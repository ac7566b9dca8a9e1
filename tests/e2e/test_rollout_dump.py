"""A short real run with verl's ``trainer.rollout_data_dir``: each step's samples land in
``DIR/STEP.jsonl`` with verl's fields, the same samples ``relay rollouts`` reads back from the
rollout log, and ``relay plot`` draws the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, launch, small_run_overrides

pytestmark = pytest.mark.e2e

STEPS = 3
BATCH, N = 4, 4  # data.train_batch_size and rollout.n of small_run_overrides


def relay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relay", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_a_run_dumps_each_step_as_verl_does_and_the_tools_read_it(random_model_dir: Path,
                                                                   run_root: Path,
                                                                   tmp_path: Path) -> None:
    dump = tmp_path / "rollout-dump"
    result = launch(small_run_overrides(random_model_dir, run_root, steps=STEPS)
                    + [f"trainer.rollout_data_dir={dump}"])
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_root.iterdir()
    assert sorted(p.name for p in dump.iterdir()) == [f"{s}.jsonl" for s in range(1, STEPS + 1)]
    lines = [json.loads(line) for line in (dump / "2.jsonl").read_text().splitlines()]
    assert len(lines) == BATCH * N
    assert all({"input", "output", "gts", "score", "step"} <= line.keys() for line in lines)
    assert {line["step"] for line in lines} == {2}

    read = relay("rollouts", str(run_dir), "--step", "2", "--jsonl", "-")
    assert read.returncode == 0, read.stderr
    groups = [json.loads(line) for line in read.stdout.splitlines()]
    assert [(g["prompt"], r["text"], r["reward"]) for g in groups for r in g["responses"]] == [
        (line["input"], line["output"], line["score"]) for line in lines]

    plots = relay("plot", str(run_dir))
    assert plots.returncode == 0, plots.stderr
    assert (run_dir / "plots" / "reward.png").is_file()
