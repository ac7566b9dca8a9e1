"""Offline replay: ``tools/replay-rollouts.py`` re-trains a finished run's recorded batches
and agrees with what the live run logged.

One short run at eta = 0 with checkpoints every 2 steps; then the replay from the start
(the initial weights) and from the checkpoint before step 4, each compared with the
run's MLflow metrics step by step.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, launch, small_run_overrides

pytestmark = pytest.mark.e2e

REPLAY = ROOT / "tools" / "replay-rollouts.py"
STEPS = 6
TOLERANCE = 1e-4


def replay(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPLAY), str(run_dir), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_replay_retrains_each_recorded_step_to_the_live_metrics(random_model_dir: Path,
                                                                  run_root: Path) -> None:
    result = launch(small_run_overrides(random_model_dir, run_root, steps=STEPS) + [
        "buffer.max_staleness=0", "trainer.save_freq=2", "checkpoint.keep_last=5",
        "trainer.test_freq=-1", "trainer.val_before_train=false"])
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = run_root.iterdir()

    whole = replay(run_dir, "--tolerance", str(TOLERANCE))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    rows = re.findall(r"^\s*(\d+)\s+loss (\S+) \(live (\S+)\)", whole.stdout, re.M)
    assert [int(step) for step, _, _ in rows] == list(range(1, STEPS + 1))
    assert all(live != "-" for _, _, live in rows)
    assert "from model.path" in whole.stderr

    tail = replay(run_dir, "--from-step", "4", "--to-step", "5", "--tolerance", str(TOLERANCE))
    assert tail.returncode == 0, tail.stdout + tail.stderr
    assert "step-2" in tail.stderr
    assert [int(s) for s in re.findall(r"^\s*(\d+)\s+loss", tail.stdout, re.M)] == [3, 4, 5]


def test_replay_names_what_it_cannot_replay(tmp_path: Path) -> None:
    missing = replay(tmp_path / "nowhere")
    assert missing.returncode == 2 and "nowhere" in missing.stderr
