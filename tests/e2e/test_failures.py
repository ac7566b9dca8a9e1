"""Failures while a run is going: a dead generator, a dead essential process, Ctrl-C.

- Two generators; the first to report a lease is SIGKILLed (its whole process group).
  Not restarted (``max_restarts = 0``), the run must still finish, and the buffer must
  have returned its unanswered prompts to the pool when the lease timed out (the heartbeat
  timeout is set longer, so the lease timeout is what returns them).
- One generator, SIGKILLed holding its first lease, is restarted (the default): it must
  attach again under its name within 30 s, its leased prompts back in the pool, and train
  the run to its end; so must one started over ssh (``fake_ssh.py``: its pid is not the
  ssh client's), as the restart is of its lineage, whatever its pid. Either way the
  buffer's accounting must hold at every step.
- The buffer is killed, or stops cleanly on SIGTERM: the launcher stops everything and
  exits non-zero naming it.
- Ctrl-C on the launcher: everything stops, exit code 130.
- The buffer frozen for 35 s: every client retries and the run finishes.
- Generators frozen: the watchdog ends the run, pointing at generation.
In every case no process of the run is left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import LAUNCHER, ROOT, processes_mentioning, small_run_overrides

pytestmark = pytest.mark.e2e

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
[[generators]]
name = "gen1"
threads = 1
"""
NO_RESTARTS = TOPOLOGY.replace("threads = 1\n", "threads = 1\nmax_restarts = 0\n")
ONE_GENERATOR = TOPOLOGY[:TOPOLOGY.index("[[generators]]\nname = \"gen1\"")]
REATTACH_S = 30.0  # issue 34: a killed generator is back within this, killed to attached
FAKE_SSH = Path(__file__).with_name("fake_ssh.py")  # runs the "remote" command here


def wait_for(path: Path, pattern: str, timeout_s: float) -> re.Match:
    return wait_for_any([path], pattern, timeout_s)[1]


def wait_for_any(paths: list[Path], pattern: str, timeout_s: float) -> tuple[Path, re.Match]:
    """The first of ``paths`` (checked in order, again and again) where ``pattern`` appears,
    and the match."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in paths:
            match = path.exists() and re.search(pattern, path.read_text(errors="replace"))
            if match:
                return path, match
        time.sleep(0.02)
    raise AssertionError(f"{pattern!r} never appeared in {', '.join(map(str, paths))}")


def pid_of(run_dir: Path, *fragments: str) -> int:
    for line in processes_mentioning(str(run_dir)):
        pid, cmdline = line.split(": ", 1)
        if all(f in cmdline for f in fragments):
            return int(pid)
    raise AssertionError(f"no process of {run_dir} matching {fragments}")


def wait_for_pid(run_dir: Path, timeout_s: float, *fragments: str) -> int:
    """``pid_of`` once such a process runs (the launcher starts it a little later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return pid_of(run_dir, *fragments)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def start_launcher(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LAUNCHER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def first_run_dir(run_root: Path, timeout_s: float = 60) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [p for p in run_root.iterdir() if (p / "logs").is_dir()]
        if runs:
            return runs[0]
        time.sleep(0.1)
    raise AssertionError(f"no run directory appeared in {run_root}")


def start_killing_run(topology_text: str, random_model_dir: Path, run_root: Path,
                      tmp_path: Path, *, generators: tuple[str, ...], lease_timeout_s: float,
                      extra_args: tuple[str, ...] = ()
                      ) -> tuple[subprocess.Popen, Path, str, int, re.Match]:
    """A 30-step run (and ``extra_args``) whose first generator to get a lease is SIGKILLed
    holding it (its process group): the launcher, the run directory, the killed generator's
    name and the pid of a process of its group, and its lease."""
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_text)
    run_config = ROOT / "configs" / "arithmetic-grpo.toml"
    # 30 steps: training goes on well past the killed generator's lease expiry or restart
    args = [a for a in small_run_overrides(random_model_dir, run_root, steps=30)
            if not a.startswith("topology.")]
    # 64 new tokens a sample (the random model rarely stops early): a lease takes long
    # enough that the kill below lands before its groups are all sent
    args += ["rollout.response_length=64", "trainer.val_before_train=false",
             "trainer.test_freq=-1", f"buffer.lease_timeout_s={lease_timeout_s}",
             "buffer.heartbeat_timeout_s=600", "buffer.max_staleness=2",
             f"buffer.min_generators={len(generators)}",  # leasing begins once all are there
             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra_args]
    launcher = start_launcher([str(topology), str(run_config), *args])
    try:
        run_dir = first_run_dir(run_root)
        # the generators' pids, looked up as they start (long before leasing begins, once
        # all attached), so that the first to get a lease dies holding it within a poll of
        # the line (another may get every lease after)
        pids = {name: wait_for_pid(run_dir, 120, "relay.generators.main", f"--name {name}")
                for name in generators}
        log, lease = wait_for_any([run_dir / "logs" / f"{name}.log" for name in pids],
                                  r"lease (L\d+): (\d+) prompts", 120)
        os.killpg(pids[log.stem], signal.SIGKILL)
    except BaseException:
        launcher.kill()
        raise
    return launcher, run_dir, log.stem, pids[log.stem], lease


def assert_accounting_held(tmp_path: Path) -> MlflowClient:
    """The buffer's accounting held at every step the learner logged; the run's tracker."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    accounting = client.get_metric_history(run.info.run_id, "buffer/accounting_problems")
    assert accounting and all(m.value == 0 for m in accounting)  # at every step
    return client


def test_training_survives_a_dead_generator(random_model_dir: Path, run_root: Path,
                                            tmp_path: Path) -> None:
    launcher, run_dir, name, _pid, lease = start_killing_run(
        NO_RESTARTS, random_model_dir, run_root, tmp_path, generators=("gen0", "gen1"),
        lease_timeout_s=4)
    try:
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    assert f"generator {name} died (killed by SIGKILL); training goes on without it" in output
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    expired = re.search(r"(\d+) leased prompts expired; back in the pool", buffer_log)
    assert expired, f"lease {lease.group(1)} never expired:\n{buffer_log}"
    assert processes_mentioning(str(run_dir)) == []
    assert_accounting_held(tmp_path)


def wait_for_count(path: Path, text: str, count: int, timeout_s: float) -> None:
    """Until ``text`` appears ``count`` times in ``path``."""
    deadline = time.monotonic() + timeout_s
    while path.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not {count} times in {path} within "
                                 f"{timeout_s:.0f} s:\n{path.read_text(errors='replace')}")
        time.sleep(0.05)


@pytest.mark.slow  # 50-80 s: the slow tier
def test_a_killed_generator_is_restarted_and_attaches_again_within_30_s(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    # the only generator: the run cannot end before it is back. Its leases outlive the test
    # (and its name, its silence): only the restart returns them
    launcher, run_dir, name, _pid, lease = start_killing_run(
        ONE_GENERATOR, random_model_dir, run_root, tmp_path, generators=("gen0",),
        lease_timeout_s=600)
    assert_restarted_and_reattached(launcher, run_dir, name, lease, tmp_path)


@pytest.mark.slow  # 30-60 s: the slow tier
def test_a_killed_ssh_generator_is_restarted_and_attaches_again_within_30_s(
        random_model_dir: Path, run_root: Path, tmp_path: Path, curve_keys: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    ssh = ("topology.security.curve=true", f"topology.security.keys_dir={curve_keys}",
           "topology.generators[0].host=gen-host.example", "topology.launcher.backend=ssh",
           f"topology.launcher.ssh={sys.executable} {FAKE_SSH}",
           f"topology.launcher.remote_python={sys.executable}",
           f"topology.launcher.remote_workdir={ROOT}")
    launcher, run_dir, name, _pid, lease = start_killing_run(
        ONE_GENERATOR, random_model_dir, run_root, tmp_path, generators=("gen0",),
        lease_timeout_s=600, extra_args=ssh)
    assert_restarted_and_reattached(launcher, run_dir, name, lease, tmp_path)
    started = [line for line in (tmp_path / "ssh.log").read_text().splitlines()
               if "relay.generators.main" in line]
    lineages = {re.search(r"--lineage ([0-9a-f]+)", line).group(1) for line in started}
    assert len(started) == 2 and len(lineages) == 1, started  # the restart: one lineage


def assert_restarted_and_reattached(launcher: subprocess.Popen, run_dir: Path, name: str,
                                    lease: re.Match, tmp_path: Path) -> None:
    """The killed generator ``name`` (``start_killing_run``) attached again within
    ``REATTACH_S`` in place of its first process, its lease back in the pool, and the run
    trained to its end."""
    try:
        killed_at = time.monotonic()
        buffer_log = run_dir / "logs" / "buffer.log"
        wait_for_count(buffer_log, f"generator {name} attached", 2, REATTACH_S)
        reattached_s = time.monotonic() - killed_at
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    assert f"generator {name} died (killed by SIGKILL); starting it again in 1 s (restart " \
           "1 of 3); training goes on" in output
    assert f"generator {name} started again (restart 1)" in output
    log = buffer_log.read_text()
    pid = re.search(rf"generator {name} attached \(.*, pid (\d+),", log).group(1)  # first
    replaced = re.search(rf"generator {name} restarted, replacing pid {pid} on \S+ "
                         r"\((\d+) leased prompts back in the pool\)", log)
    assert replaced and int(replaced.group(1)) > 0, f"lease {lease.group(1)} not returned " \
                                                    f"({reattached_s:.1f} s):\n{log}"
    assert "leased prompts expired" not in log
    # the restarted process leased again (its first lease is logged, like the first's)
    generator_log = (run_dir / "logs" / f"{name}.log").read_text()
    assert len(re.findall(r"lease L\d+: \d+ prompts", generator_log)) == 2, generator_log
    assert processes_mentioning(str(run_dir)) == []
    client = assert_accounting_held(tmp_path)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    replaced_counts = client.get_metric_history(run.info.run_id, "buffer/generators/replaced")
    assert max(m.value for m in replaced_counts) == 1


def quick_args(model_dir: Path, run_root: Path, tmp_path: Path) -> list[str]:
    return small_run_overrides(model_dir, run_root, steps=1000) + [
        "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]


@pytest.mark.parametrize(("sig", "named"), [
    (signal.SIGKILL, "essential process buffer (buffer) died: killed by SIGKILL"),
    # the buffer stops cleanly on SIGTERM, exit code 0: the run is still not over
    (signal.SIGTERM, "essential process buffer (buffer) exited (exit code 0) before the "
                     "learner finished")])
def test_a_dead_buffer_ends_the_run_and_is_named(random_model_dir: Path, run_root: Path,
                                                 tmp_path: Path, sig: signal.Signals,
                                                 named: str) -> None:
    launcher = start_launcher(quick_args(random_model_dir, run_root, tmp_path))
    try:
        run_dir = first_run_dir(run_root)
        wait_for(run_dir / "logs" / "gen0.log", r"lease L\d+", 120)
        os.kill(pid_of(run_dir, "relay.buffer.main"), sig)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, output
    assert named in output
    assert processes_mentioning(str(run_dir)) == []


def test_ctrl_c_stops_everything(random_model_dir: Path, run_root: Path,
                                 tmp_path: Path) -> None:
    launcher = start_launcher(quick_args(random_model_dir, run_root, tmp_path))
    try:
        run_dir = first_run_dir(run_root)
        wait_for(run_dir / "logs" / "gen0.log", r"lease L\d+", 120)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, output
    assert "interrupted" in output
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow  # over a minute each: the slow tier
def test_the_watchdog_ends_a_run_that_makes_no_step_and_names_the_stage(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    """Both generators frozen (SIGSTOP) after the first step: the learner waits for
    batches forever; the watchdog ends the run and points at generation."""
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    args = [a for a in quick_args(random_model_dir, run_root, tmp_path)
            if not a.startswith("topology.")]
    launcher = start_launcher([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"),
                               *args, "trainer.progress_timeout_s=30",
                               "buffer.heartbeat_timeout_s=600"])
    try:
        run_dir = first_run_dir(run_root)
        wait_for(run_dir / "logs" / "gen0.log", r"now generating with weights version [1-9]", 180)
        for name in ("gen0", "gen1"):
            os.kill(pid_of(run_dir, "relay.generators.main", f"--name {name}"), signal.SIGSTOP)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, output
    assert "no learner step for" in output and "trainer.progress_timeout_s = 30" in output
    assert "generation: the buffer holds" in output
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow  # over a minute each: the slow tier
def test_a_stalled_buffer_does_not_kill_the_run(random_model_dir: Path, run_root: Path,
                                                tmp_path: Path) -> None:
    """The buffer frozen (SIGSTOP) for 35 s, longer than any request's timeout: the
    generators and the learner retry (buffer.client_patience_s) and the run finishes."""
    args = small_run_overrides(random_model_dir, run_root, steps=12) + [
        "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    launcher = start_launcher(args)
    try:
        run_dir = first_run_dir(run_root)
        wait_for(run_dir / "logs" / "gen0.log", r"now generating with weights version [1-9]", 180)
        buffer = pid_of(run_dir, "relay.buffer.main")
        os.kill(buffer, signal.SIGSTOP)
        time.sleep(35)
        os.kill(buffer, signal.SIGCONT)
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    assert "trained 12 steps" in output
    assert processes_mentioning(str(run_dir)) == []
