"""A generator on a "remote" host, started through the launcher's ssh path.

``topology.launcher.ssh`` points at ``fake_ssh.py``, which runs each remote command on this
machine, so the whole remote path is exercised for real: the resolved configs are pushed
over "ssh" into the remote run directory, the generator is started there with
``remote_python`` in ``remote_workdir``, talks to the buffer and learner with CURVE (required
because its host is not loopback), and is stopped by hanging up when the run ends. It is
the only generator, so the three steps trained are its rollouts. The "remote" run directory
is the local one, as on a cluster's shared filesystem: the push must not truncate it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, launch, only_run_dir, processes_mentioning, small_run_overrides

pytestmark = pytest.mark.e2e

FAKE_SSH = Path(__file__).with_name("fake_ssh.py")
REMOTE_HOST = "gen-host.example"


def test_a_remote_generator_is_started_over_ssh_and_trains(
        random_model_dir: Path, run_root: Path, curve_keys: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    keys = curve_keys
    ssh_log = tmp_path / "ssh.log"
    monkeypatch.setenv("FAKE_SSH_LOG", str(ssh_log))

    args = small_run_overrides(random_model_dir, run_root, steps=3) + [
        "topology.security.curve=true", f"topology.security.keys_dir={keys}",
        f"topology.generators[0].host={REMOTE_HOST}", "topology.launcher.backend=ssh",
        f"topology.launcher.ssh={sys.executable} {FAKE_SSH}",
        f"topology.launcher.remote_python={sys.executable}",
        f"topology.launcher.remote_workdir={ROOT}"]
    result = launch(args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained 3 steps" in result.stdout
    run_dir = only_run_dir(run_root)
    assert processes_mentioning(str(run_dir)) == []

    calls = [line.split("\t", 1) for line in ssh_log.read_text().splitlines()]
    assert {host for host, _ in calls} == {REMOTE_HOST}
    commands = [command for _, command in calls]
    assert any(c.startswith("mkdir -p ") and str(run_dir) in c for c in commands)
    pushed = [c for c in commands if c.startswith("cat > ")]
    assert len(pushed) == 2 and all(" && mv " in c for c in pushed)  # topology and run
    started = [c for c in commands if "relay.generators.main" in c]
    # env(1) leads when the launcher forwards NCCL_* / CUDA_* variables it has
    assert len(started) == 1 and re.match(
        rf"cd {re.escape(str(ROOT))} && (env (\S+=\S* )+)?{re.escape(sys.executable)} ",
        started[0]), started[0]
