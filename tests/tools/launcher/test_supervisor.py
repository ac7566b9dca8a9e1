"""The supervisor's stop (waves, a second signal) and how it names a dead process's cause."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relay.configs.topology_schema import Topology
from relay.launcher import ports, supervisor
from relay.launcher.backends import PopenHandle, SubprocessBackend
from relay.launcher.plan import ProcessSpec
from relay.launcher.supervisor import Running, last_exception, stop_all

CHILD_TRACEBACK = """\
step 3 | loss 0.1
[rank0]: Traceback (most recent call last):
[rank0]:   File "learner/checkpoint.py", line 80, in save
[rank0]:     folder.mkdir(parents=True)
[rank0]: NotADirectoryError: [Errno 20] Not a directory: '/tmp/a-file/checkpoints'
E1124 18:00:00 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
relay.learner.main FAILED
"""


def test_the_cause_is_the_childs_exception_not_torchruns_report(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    log.write_text(CHILD_TRACEBACK)
    assert last_exception(log) == ("NotADirectoryError: [Errno 20] Not a directory: "
                                   "'/tmp/a-file/checkpoints'")


def test_the_last_of_several_tracebacks_is_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "buffer.log"
    log.write_text("Traceback (most recent call last):\n  File \"a.py\", line 1\n"
                   "KeyError: 'x'\n\nDuring handling of the above exception, another "
                   "exception occurred:\n\nTraceback (most recent call last):\n"
                   "  File \"a.py\", line 3\nconfigs.ConfigError: run.toml: bad key\n"
                   "INFO after the traceback\n")
    assert last_exception(log) == "configs.ConfigError: run.toml: bad key"


def test_a_log_without_a_traceback_or_no_log_names_no_cause(tmp_path: Path) -> None:
    log = tmp_path / "gen0.log"
    log.write_text("ValueError: a line that quotes an error is no traceback\n")
    assert last_exception(log) == ""
    assert last_exception(tmp_path / "missing.log") == ""


RECORDER = """\
import signal, sys, time
def on_term(*_):
    time.sleep({delay})
    open(sys.argv[1], "a").write(f"{{time.monotonic()}}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term if {stops} else signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def start(tmp_path: Path, name: str, role: str, *, delay: float = 0.0,
          stops: bool = True) -> Running:
    """A process that notes when SIGTERM stopped it (after ``delay``), or ignores it."""
    spec = ProcessSpec(name=name, role=role, host="127.0.0.1",  # type: ignore[arg-type]
                       argv=[sys.executable, "-c", RECORDER.format(delay=delay, stops=stops),
                             str(tmp_path / f"{name}.stopped")])
    popen = subprocess.Popen(spec.argv, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert popen.stdout is not None and popen.stdout.readline() == "ready\n"
    return Running(spec=spec, process=PopenHandle(popen), log=tmp_path / f"{name}.log")


def stopped_at(tmp_path: Path, name: str) -> float:
    return float((tmp_path / f"{name}.stopped").read_text())


def test_the_buffer_is_stopped_after_the_processes_that_talk_to_it(tmp_path: Path) -> None:
    generator = start(tmp_path, "gen0", "generator", delay=0.5)  # returns its leases
    buffer = start(tmp_path, "buffer", "buffer")
    learner = start(tmp_path, "learner", "learner")
    stop_all([buffer, learner, generator])
    assert all(p.process.poll() is not None for p in (generator, buffer, learner))
    assert stopped_at(tmp_path, "buffer") > stopped_at(tmp_path, "gen0")
    assert stopped_at(tmp_path, "buffer") > stopped_at(tmp_path, "learner")


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 1.0)
    stubborn = start(tmp_path, "gen0", "generator", stops=False)
    began = time.monotonic()
    stop_all([stubborn])
    assert stubborn.process.poll() == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - began < 10.0


def test_a_second_ctrl_c_while_stopping_skips_the_grace(tmp_path: Path) -> None:
    stubborn = start(tmp_path, "gen0", "generator", stops=False)
    buffer = start(tmp_path, "buffer", "buffer")
    own_handler = signal.getsignal(signal.SIGINT)  # SIG_IGN where pytest runs in background
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    stop_all([stubborn, buffer])  # no KeyboardInterrupt out of it
    assert time.monotonic() - began < supervisor.STOP_GRACE_S / 2
    assert stubborn.process.poll() == -signal.SIGKILL and buffer.process.poll() is not None
    assert signal.getsignal(signal.SIGINT) is own_handler  # given back


LEADER_WITH_A_STUBBORN_CHILD = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "held = b'x' * (768 << 20); print(flush=True); time.sleep(600)"],
                         stdout=subprocess.PIPE)  # held: slow to tear down
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` lives (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def test_no_member_of_a_group_outlives_the_stop(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader that dies at SIGTERM leaves a child that ignores it (torchrun's workers):
    the SIGKILL sweep gets it, and the stop returns only once it is gone."""
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 1.0)
    spec = ProcessSpec(name="learner", role="learner", host="127.0.0.1",  # type: ignore[arg-type]
                       argv=[sys.executable, "-c", LEADER_WITH_A_STUBBORN_CHILD])
    popen = subprocess.Popen(spec.argv, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert popen.stdout is not None
    child = int(popen.stdout.readline())
    stop_all([Running(spec=spec, process=PopenHandle(popen), log=tmp_path / "learner.log")])
    assert not alive(child)


def test_free_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """A port below the ephemeral range is not handed to another process's bind(0) or
    outgoing connection between our pick and our bind; a taken pick is skipped."""
    import random
    import socket

    low = int(ports.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    first = random.Random(7).randrange(ports.LOWEST_PICKED_PORT, low)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))  # the first pick of that seed is taken
        port = ports.free_port(random.Random(7))
    assert port != first and ports.LOWEST_PICKED_PORT <= port < low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # and it is free


def test_processes_start_with_sleeping_openmp_threads_and_a_malloc_that_keeps_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OMP_WAIT_POLICY and glibc's malloc settings are defaults: a user's own value wins."""
    names = ("OMP_WAIT_POLICY", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    spec = ProcessSpec(name="gen0", role="generator", host="127.0.0.1",
                       argv=[sys.executable, "-c", "import os; print([os.environ.get(n) for n "
                                                   f"in {names!r}])"])
    log = tmp_path / "gen0.log"
    assert SubprocessBackend("local").start(spec, Topology(), log).popen.wait(timeout=60) == 0
    assert log.read_text().strip() == str(["PASSIVE", str(32 << 20), "12345"])


def test_a_local_process_starts_with_the_environment_its_plan_gives_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ProcessSpec.env`` (its GPUs, ``relay.launcher.plan``) is set before the process runs, over
    the launcher's own value; the rest of the launcher's environment is inherited."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    names = ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG")
    spec = ProcessSpec(name="gen0", role="generator", host="127.0.0.1",
                       env={"CUDA_VISIBLE_DEVICES": "2"},
                       argv=[sys.executable, "-c", "import os; print([os.environ.get(n) for n "
                                                   f"in {names!r}])"])
    log = tmp_path / "gen0.log"
    assert SubprocessBackend("local").start(spec, Topology(), log).popen.wait(timeout=60) == 0
    assert log.read_text().strip() == str(["2", "INFO"])
