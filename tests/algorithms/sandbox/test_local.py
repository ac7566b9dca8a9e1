"""The local sandbox against hostile programs: each ends non-ok with a reason, the test process
and the pool survive, and the next trivial program still runs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import pytest

from relay.algorithms.sandbox.api import Execution, Limits
from relay.algorithms.sandbox.local import LocalSandbox

SECRET = "relay-test-secret-7f3a"


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(workers=2) as box:
        yield box


@pytest.fixture(autouse=True)
def pool_survives(sandbox):
    """After every test the pool still runs a trivial program."""
    yield
    after = sandbox.run("print(1)")
    assert (after.status, after.stdout) == ("ok", "1\n"), after


def hostile(execution: Execution, *statuses: str) -> None:
    assert execution.status in statuses, execution
    assert execution.reason, execution


def needs_uid_boundary(sandbox: LocalSandbox) -> None:
    if not sandbox.uid_isolated:
        pytest.skip("the uid boundary needs root; as the caller's uid a program can do this")


def test_a_fork_bomb_is_refused(sandbox):
    bomb = "import os\nwhile True:\n    os.fork()\n"
    result = sandbox.run(bomb, limits=Limits(processes=1))
    hostile(result, "error")
    assert "Resource temporarily unavailable" in result.reason


def test_a_fork_bomb_with_a_process_budget_ends_and_leaves_nothing_behind(sandbox):
    needs_uid_boundary(sandbox)
    # each child leaves the process group, so only the uid sweep can find it
    bomb = ("import os, time\nfor _ in range(64):\n    try:\n        if os.fork() == 0:\n"
            "            os.setsid()\n    except OSError:\n        pass\ntime.sleep(60)\n")
    result = sandbox.run(bomb, limits=Limits(processes=8, wall_s=1.0))
    hostile(result, "timeout")
    left = _still_running_as(sandbox.uids)
    assert left == [], [_describe(pid) for pid in left]


def _describe(pid: str) -> str:
    try:
        status = open(f"/proc/{pid}/status").read()
        keep = [line for line in status.splitlines()
                if line.split(":")[0] in ("State", "PPid", "Uid", "SigPnd", "ShdPnd")]
        parent = keep[1].split()[1] if len(keep) > 1 else "?"
        return f"{pid}: {keep} parent cmd {open(f'/proc/{parent}/cmdline').read()[:120]!r}"
    except OSError as error:
        return f"{pid}: gone ({error})"


def _still_running_as(uids: range, within_s: float = 5.0) -> list[str]:
    """``_running_as`` once it is empty, or after ``within_s`` (a SIGKILLed process takes
    a moment to finish exiting)."""
    deadline = time.monotonic() + within_s
    while (running := _running_as(uids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


def _running_as(uids: range) -> list[str]:
    """Processes of those uids that are not zombies (killed, waiting to be reaped)."""
    running = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if uid in uids and state != "Z":
            running.append(pid)
    return running


def test_an_infinite_loop_hits_the_cpu_limit(sandbox):
    result = sandbox.run("while True:\n    pass\n", limits=Limits(cpu_s=1, wall_s=20))
    hostile(result, "timeout")
    assert "CPU time" in result.reason


def test_a_sleeping_program_is_killed_at_the_wall_clock(sandbox):
    start = time.monotonic()
    result = sandbox.run("import time\ntime.sleep(60)\n", limits=Limits(wall_s=0.5))
    hostile(result, "timeout")
    assert "wall-clock" in result.reason and time.monotonic() - start < 10


def test_a_20_gb_allocation_fails_with_memory(sandbox):
    result = sandbox.run("x = bytearray(20 << 30)\n")
    hostile(result, "memory")
    assert "1024 MB" in result.reason


def test_writing_outside_its_directory_fails(sandbox, tmp_path):
    needs_uid_boundary(sandbox)
    target = tmp_path / "escaped.txt"
    result = sandbox.run(f"open({str(target)!r}, 'w').write('x')\n")
    hostile(result, "error")
    assert "PermissionError" in result.reason and not target.exists()


def test_the_parent_environment_is_not_visible(sandbox, monkeypatch):
    needs_uid_boundary(sandbox)
    monkeypatch.setenv("RELAY_SANDBOX_SECRET", SECRET)
    program = f"""
import os
found = [v for v in os.environ.values() if {SECRET!r} in v]
for pid in (os.getppid(), {os.getpid()}):
    try:
        found += [open(f"/proc/{{pid}}/environ", "rb").read().decode("latin-1")]
    except OSError as error:
        print(pid, error)
if not any({SECRET!r} in text for text in found):
    raise SystemExit("no secret")
print("".join(found))
"""
    result = sandbox.run(program)
    hostile(result, "error")
    assert SECRET not in result.stdout + result.stderr
    assert "Permission denied" in result.stdout


def test_a_network_socket_cannot_connect(sandbox):
    if not sandbox.network_isolated:
        pytest.skip("this kernel refuses network namespaces")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}),"
                             " timeout=2)\nprint('connected')\n")
    hostile(result, "error")
    assert "connected" not in result.stdout
    allowed = sandbox.run(f"print({port})", limits=Limits(network=True))
    assert allowed.status == "ok", allowed


def test_killing_the_parent_or_the_test_process_fails(sandbox):
    needs_uid_boundary(sandbox)
    for pid in ("os.getppid()", str(os.getpid())):
        result = sandbox.run(f"import os, signal\nos.kill({pid}, signal.SIGKILL)\n")
        hostile(result, "error")
        assert "PermissionError" in result.reason


def test_a_dead_zygote_fails_its_program_and_is_restarted():
    with LocalSandbox(workers=1) as box:
        needs_uid_boundary(box)  # to tell the program from the zygote's spares, by uid
        uids = box.uids
        running = box.submit("import time\ntime.sleep(30)\n")
        zygote = box._zygotes[False].process
        deadline = time.monotonic() + 10
        while not (programs := [pid for pid in zygote_children(zygote.pid)
                                if _uid(pid) in uids]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(zygote.pid, signal.SIGKILL)
        result = running.result(timeout=10)
        hostile(result, "sandbox_error")
        assert "zygote" in result.reason
        assert box.run("print(1)").stdout == "1\n"
        # the kernel kills the orphaned program (its parent-death signal)
        left = _still_running_as(uids)
        assert left == [], (programs, [_describe(pid) for pid in left])


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def zygote_children(pid: int) -> list[int]:
    """The zygote's children (its spares and running programs)."""
    try:
        return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def test_stdin_reaches_the_program_and_stdout_comes_back(sandbox):
    text = "héllo\n" * 10_000  # larger than a pipe's buffer
    result = sandbox.run("import sys\nsys.stdout.write(sys.stdin.read().upper())\n",
                         stdin=text)
    assert (result.status, result.exit_code, result.reason) == ("ok", 0, "")
    assert result.stdout == text.upper()


def test_files_are_written_into_a_fresh_directory_and_importable(sandbox):
    files = {"solution.py": "def add(a, b):\n    return a + b\n", "data/in.txt": "2 3"}
    program = ("import os, solution\nprint(solution.add(*map(int, open('data/in.txt')"
               ".read().split())))\nprint(sorted(os.listdir('.')))\n")
    result = sandbox.run(program, files=files)
    assert result.stdout.splitlines() == ["5", "['data', 'solution.py']"], result
    again = sandbox.run("import os\nprint(os.listdir('.'))\n")
    assert again.stdout == "[]\n"


def test_a_file_name_leaving_the_directory_is_refused(sandbox):
    for name in ("/etc/x", "../x", "a/../../x", ""):
        with pytest.raises(ValueError, match="relative path"):
            sandbox.run("pass", files={name: "x"})


def test_exit_codes_and_exceptions(sandbox):
    assert sandbox.run("raise SystemExit(3)").exit_code == 3
    result = sandbox.run("import sys\nsys.exit(3)\n")
    assert (result.status, result.exit_code, result.reason) == ("error", 3,
                                                                "exited with code 3")
    failed = sandbox.run("1 / 0\n")
    assert failed.status == "error"
    assert failed.reason.endswith("ZeroDivisionError: division by zero")
    assert "zygote" not in failed.stderr  # the traceback shows the program, not the sandbox
    killed = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert (killed.status, killed.exit_code, killed.reason) == ("killed", -11,
                                                                "killed by SIGSEGV")


def test_output_past_the_cap_is_cut(sandbox):
    result = sandbox.run("print('x' * 10_000)\n", limits=Limits(output_bytes=100))
    assert result.stdout == "x" * 100 and "stdout cut at 100 bytes" in result.reason
    flood = sandbox.run("while True:\n    print('y' * 1000)\n",
                        limits=Limits(output_bytes=1000, cpu_s=2))
    assert flood.status == "error" and len(flood.stdout) == 1000
    assert "BrokenPipeError" in flood.stderr


def test_the_environment_is_minimal(sandbox):
    result = sandbox.run("import os, json\nprint(json.dumps(dict(os.environ)))\n")
    keys = set(__import__("json").loads(result.stdout))
    assert keys == {"PATH", "LANG", "HOME", "TMPDIR", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "MKL_NUM_THREADS"}


def test_concurrent_runs_from_threads(sandbox):
    results: dict[int, Execution] = {}

    def one(i: int) -> None:
        results[i] = sandbox.run(f"import time\ntime.sleep(0.2)\nprint({i})\n")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i}\n" for i in range(8)}
    assert time.monotonic() - start < 8 * 0.2  # two workers: about 4 rounds, not 8


def test_arun_does_not_block_the_event_loop(sandbox):
    async def main() -> tuple[list[Execution], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        runs = await asyncio.gather(*(sandbox.arun(f"import time\ntime.sleep(0.3)\nprint({i})")
                                      for i in range(4)))
        tick.cancel()
        return runs, ticks

    runs, ticks = asyncio.run(main())
    assert [r.stdout for r in runs] == [f"{i}\n" for i in range(4)]
    assert ticks >= 20  # ~0.6 s of runs: the loop kept ticking


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_io_thread_fails_its_programs_and_refuses_new_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No caller waits forever on a dead I/O thread: its programs end as sandbox errors
    and the sandbox refuses new ones (found under load: a stale selector event)."""
    def broken(self: LocalSandbox, fd: int, run: object, kind: str) -> None:
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(LocalSandbox, "_on_pipe", broken)
    with LocalSandbox(workers=1) as box:
        result = box.submit("print(1)\n").result(timeout=30)
        assert result.status == "sandbox_error"
        assert "the sandbox failed" in result.reason and "Bad file descriptor" in result.reason
        with pytest.raises(RuntimeError, match="closed"):
            box.run("print(1)\n")
