"""A run keeps what it made: three steps of the embedded default (the builtin tiny model),
launched from an empty working directory, leave ``RUN_DIR/final/`` that transformers loads
with its tokenizer, equal to the last checkpoint as ``relay export`` writes it; the
learner's last line names the folder; and no ``mlruns/`` lands in the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relay.export import main as export

from .conftest import LAUNCHER, only_run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~40-90 s: a real run

FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]
NO_EVALUATION = ["trainer.test_freq=-1", "trainer.val_before_train=false"]  # not tested here


def test_the_default_run_keeps_its_final_policy(run_root: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    result = subprocess.run(
        [sys.executable, str(LAUNCHER), f"trainer.run_dir={run_root}",
         "trainer.total_training_steps=3", "trainer.save_freq=3", *NO_EVALUATION,
         *FREE_PORTS],
        capture_output=True, text=True, timeout=600, cwd=project,
        env=dict(os.environ, RELAY_LOG_LEVEL="INFO"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(project.iterdir()) == [], "the run wrote into the working directory"
    run_dir = only_run_dir(run_root)
    final = run_dir / "final"
    assert not (run_dir / "final.tmp").exists()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"the trained policy is in {final}" in learner_log

    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer("1+2=", return_tensors="pt")
    assert model.generate(**prompt, max_new_tokens=2, do_sample=False).shape[1] > 0

    assert export([str(run_dir), str(tmp_path / "exported")]) == 0  # step-3, the last one
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
                    .named_parameters())
    for name, weight in model.named_parameters():
        assert torch.equal(weight, exported[name]), name
