"""tools/bench-learner.py: a run on a small model prints a row per configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench-learner.py"


def test_two_configurations_train_and_report_time_and_memory(random_model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(TOOL), "--model", str(random_model_dir), "--configs", "dp1,sp2+gc",
         "--steps", "2", "--groups", "2", "--n", "2", "--prompt-len", "6",
         "--response-len", "6"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| dp1 |")
            or line.startswith("| sp2+gc |")]
    assert len(rows) == 2, result.stdout
    dp1, sp2 = ([cell.strip() for cell in row.strip("|").split("|")] for row in rows)
    assert float(dp1[1]) > 0 and float(sp2[1]) > 0  # seconds per step
    assert len(dp1[3].split("/")) == 1 and len(sp2[3].split("/")) == 2  # memory per rank


@pytest.mark.parametrize("bad", [["--configs", "tp2"], ["--steps", "1"]])
def test_bad_options_are_refused(bad: list[str]) -> None:
    result = subprocess.run([sys.executable, str(TOOL), *bad], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "bench-learner.py: error" in result.stderr
