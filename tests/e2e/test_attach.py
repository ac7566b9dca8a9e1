"""Attaching a generator to a running job (``tools/attach-generator.py``) and detaching it.

A run with one topology generator; mid-run a second one is attached under a fresh name. It
must join (the buffer's generator gauge, which the status line shows, reaches 2), train
(groups of its own in the rollout log), refuse a second process under its live name (which
tries again once, after the heartbeat timeout, then exits with code 3 naming the clash), and
on SIGTERM detach, returning its leases. The run then finishes normally with the buffer's
accounting intact, and attaching to the finished run is refused.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.buffer.rollout_log import read_rollout_log

from .conftest import ROOT, processes_mentioning, small_run_overrides
from .test_failures import first_run_dir, start_launcher, wait_for

pytestmark = pytest.mark.e2e

ATTACH = ROOT / "tools" / "attach-generator.py"
HEARTBEAT_TIMEOUT_S = 10  # a clashing generator gives up after it and a second
TOPOLOGY = """
[buffer]
port = 0
[learner]
weights_port = 0
weights_stream_port = 0
[launcher]
metrics_port = 0
[[generators]]
name = "gen0"
threads = 1
"""


def metric_history(run_dir: Path, name: str) -> list[float]:
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, name),
                                    key=lambda m: m.step)]


@pytest.mark.slow
def test_a_generator_attaches_mid_run_trains_and_detaches(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    # long enough to outlast the attach, the name clash and the detach (about 30 s): weights
    # stream to the generators at once, so this small model makes some 15 steps a second
    args = [a for a in small_run_overrides(random_model_dir, run_root, steps=1500)
            if not a.startswith("topology.")]
    args += ["rollout.response_length=32", "trainer.val_before_train=false",
             "trainer.test_freq=-1", f"buffer.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"]
    launcher = start_launcher([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"),
                               *args])
    attached = None
    try:
        run_dir = first_run_dir(run_root)
        wait_for(run_dir / "logs" / "gen0.log", r"lease L\d+", 120)
        attached = subprocess.Popen([sys.executable, str(ATTACH), str(run_dir), "--threads", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=ROOT)
        assert attached.stdout is not None
        first_line = attached.stdout.readline()
        name = re.search(r"starting (attached-\S+) on", first_line).group(1)
        log = run_dir / "logs" / f"{name}.log"
        wait_for(log, r"attached to", 120)
        wait_for(log, r"lease L\d+", 120)

        clash = subprocess.run([sys.executable, "-m", "relay.generators.main", "--run-dir",
                                str(run_dir), "--name", name, "--attached"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        assert clash.returncode == 3, clash.stdout + clash.stderr
        assert f"not attached yet: the name {name!r} belongs to a live generator" in clash.stderr
        assert f"generator {name} not started: the name {name!r} belongs to a live " \
               "generator" in clash.stderr

        time.sleep(3)  # some groups of its own
        attached.send_signal(signal.SIGTERM)
        rest, _ = attached.communicate(timeout=60)
        assert attached.returncode == 0, first_line + rest
        assert "its unfinished leases went back to the pool" in rest
        output, _ = launcher.communicate(timeout=600)
    finally:
        for process in (attached, launcher):
            if process is not None and process.poll() is None:
                process.kill()
    assert launcher.returncode == 0, output
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert f"generator {name} attached" in buffer_log
    assert f"generator {name} detached (stopping)" in buffer_log
    # every lease it held when stopped went back (with a model this small it often holds
    # none: tests/generators/test_attach.py stops one that surely does), none left to expire
    for lease_id in re.findall(r"returning lease (\S+): the generator is stopping",
                               log.read_text()):
        assert re.search(rf"generator {name} returned \d+ prompts of lease {lease_id}: the "
                         "generator is stopping", buffer_log), lease_id
    assert metric_history(run_dir, "buffer/prompts/expired")[-1] == 0
    assert "refused pid" in buffer_log
    assert max(metric_history(run_dir, "buffer/generators")) == 2
    assert metric_history(run_dir, "buffer/rejected/name_in_use")[-1] == 2  # and its retry
    assert metric_history(run_dir, "buffer/accounting_problems")[-1] == 0
    assert any(g.generator_id == name for g in read_rollout_log(run_dir / "rollouts"))
    assert processes_mentioning(str(run_dir)) == []
    over = subprocess.run([sys.executable, str(ATTACH), str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert over.returncode == 1 and "no buffer answers at" in over.stderr, over.stderr


def test_attaching_to_a_folder_that_is_not_a_run_is_refused(tmp_path: Path) -> None:
    not_a_run = subprocess.run([sys.executable, str(ATTACH), str(tmp_path)], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
    assert not_a_run.returncode == 2 and "is not a run directory" in not_a_run.stderr
