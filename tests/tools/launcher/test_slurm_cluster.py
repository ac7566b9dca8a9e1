"""A real ``sbatch`` of the embedded default on a Slurm cluster of this one machine, whose
generator, killed in its job step, is started again as a new step and takes its name back.

The test starts its own cluster in a temporary folder: ``munged`` with a fresh key on a
socket of its own, ``slurmctld`` and ``slurmd`` (Debian's ``slurm-wlm``) on free ports, one
node (this machine, declared with 8 CPUs: ``SlurmdParameters=config_overrides``) in one
partition; ``slurmd`` must run as root. Skipped where those are not installed or this is
not root."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.launcher.ports import free_port

REPO = Path(__file__).resolve().parents[3]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "srun", "scontrol")
pytestmark = [
    pytest.mark.slow,  # the tiny run as a Slurm job: 2 min on a busy 2-core machine
    pytest.mark.skipif(any(shutil.which(p) is None for p in DAEMONS),
                       reason="needs munge and Debian's slurm-wlm (apt-get install slurm-wlm)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd runs jobs only as root"),
]

SLURM_CONF = """\
ClusterName=relaytest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldPort={controller_port}
SlurmdPort={node_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=relay Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running one-node cluster; the environment its clients need (``SLURM_CONF``)."""
    folder = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = folder / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], folder=folder,
                                      munge_socket=munge_socket, controller_port=free_port(),
                                      node_port=free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen(["munged", "--foreground", "--force", f"--socket={munge_socket}",
                                 f"--key-file={key}", f"--log-file={folder / 'munged.log'}",
                                 f"--pid-file={folder / 'munged.pid'}",
                                 f"--seed-file={folder / 'munged.seed'}"])]
    try:
        wait_for(munge_socket.exists, "munged's socket", folder / "munged.log")
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env))
        daemons.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf)], env=env))

        def idle() -> bool:
            done = subprocess.run(["sinfo", "--noheader", "--format", "%t"], env=env,
                                  capture_output=True, text=True)
            return done.stdout.strip() == "idle"

        wait_for(idle, "an idle node", folder / "slurmd.log")
        yield env
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def wait_for(ready, what: str, log: Path, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            pytest.fail(f"no {what} within {timeout_s:.0f} s; {log}:\n{text}")
        time.sleep(0.25)


def generator_pid(run_dir: Path, name: str) -> int:
    """The pid of the run's generator ``name`` (its step's process on this one node)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"relay.generators.main" in argv and str(run_dir).encode() in argv and \
                name.encode() in argv and argv[0] != b"srun":
            return int(proc.name)
    raise AssertionError(f"no process of generator {name} of {run_dir}")


def test_the_embedded_default_trains_as_a_slurm_job_and_its_generator_heals(
        tmp_path: Path, slurm_cluster: dict[str, str]) -> None:
    runs = tmp_path / "runs"
    output = tmp_path / "launch.out"
    with open(output, "w") as out:
        launch = subprocess.Popen(
            [sys.executable, str(REPO / "tools" / "launch-cluster.py"),
             "topology.launcher.backend=slurm", "trainer.total_training_steps=6",
             f"trainer.run_dir={runs}"], cwd=REPO, env=slurm_cluster, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any("generator gen0 attached" in p.read_text() for p in
                             runs.glob("*/logs/buffer.log")),
                 "generator gen0 attached", output, timeout_s=300)
        run_dir = next(runs.iterdir())
        first = generator_pid(run_dir, "gen0")
        os.kill(first, signal.SIGKILL)  # its step's process, started by slurmstepd
        assert launch.wait(timeout=600) == 0, output.read_text()
    finally:
        if launch.poll() is None:
            launch.kill()
    text = output.read_text()
    assert "trained 6 steps" in text and "exit code 0" in text, text
    assert "generator gen0 started again (restart 1)" in text, text
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert f"replacing pid {first} on" in buffer_log  # the killed one, by its lineage
    assert (run_dir / "logs" / "slurm-exit-code").read_text().strip() == "0"
    launched = (tmp_path / "slurm" / "slurmd.log").read_text().count("launch task StepId=")
    assert launched == 5  # the buffer, the learner, the evaluator and gen0 twice
