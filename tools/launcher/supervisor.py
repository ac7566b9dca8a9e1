"""Running a resolved launch: start every process, watch them, stop them all cleanly.

Order of events:

1. prepare: build and cache a ``builtin:`` model if missing, pick free ports for port 0,
   write the resolved configs into the run directory and make its private sockets folder
   (a run without CURVE: ``relay.launcher.plan.private_sockets``);
2. start the buffer, the learner (torchrun, or one rank alone), the reward servers
   (``[[reward_models]]``), the generators and the evaluator, each in its own process
   group with its output in ``RUN_DIR/logs/<name>.log``;
3. watch: a live status line from the metrics the processes push; a generator may die
   (the run goes on while one is attached), and so may the evaluator (the run goes on
   without held-out evaluation, and the launcher says so), an essential process may not,
   not even cleanly: the buffer exiting 0 before the learner's last step ends the run too
   (after it, the buffer leaves once the generators have; the learner may still wait
   for the last held-out evaluation); a reward server is essential too, and serves until
   the launcher stops it; a
   run that makes no learner step for ``trainer.progress_timeout_s`` is ended by the
   watchdog (``relay.launcher.watchdog``), naming the stage that holds it up;
4. stop: when the learner finishes (exit 0), or on Ctrl-C, or when an essential process
   exits or the watchdog fires, every process group but the buffer's and the reward
   servers' gets SIGTERM (so that generators can still return their leases and score what
   they send), then theirs, then SIGKILL for
   what is left after a grace period; a second Ctrl-C (or SIGTERM) while stopping skips
   the grace. Nothing is left behind; the exit code says how it ended and the reason
   names the process, and for a Python exception, the exception.
"""

from __future__ import annotations

import re
import secrets
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

import msgspec

from relay.configs.checks import MODEL_PATH_KEYS, model_path_at, replace_model_path
from relay.configs.run_schema import BUILTIN_MODEL_PREFIX, RunConfig
from relay.configs.rundir import RunContext, socket_names
from relay.configs.topology_schema import Topology
from relay.launcher.backends import Backend, PlacementError, ProcessHandle, backend_for
from relay.launcher.plan import ProcessSpec, remove_sockets, write_resolved
from relay.launcher.resolve import ResolvedLaunch
from relay.launcher.status import StatusBoard
from relay.launcher.summary import summary
from relay.launcher.watchdog import ProgressWatchdog
from relay.transport.messages import Metrics
from relay.transport.sockets import Puller

LAST_WAVE = ("buffer", "reward_model")  # stopped after the rest: generators still use them
STOP_GRACE_S = 15.0  # SIGTERM, then this long (per wave), then SIGKILL
KILLED_GONE_S = 10.0  # after the SIGKILL sweep: at most this long for the killed to vanish
FINISH_GRACE_S = 30.0  # after the learner is done, how long the others get to exit
NO_GENERATOR_GRACE_S = 120.0  # the run fails when no generator is alive this long
RESTART_BACKOFF_S = 1.0  # a dead generator starts again after this, doubled per restart
RESTART_BACKOFF_MAX_S = 30.0
LINEAGE = "--lineage"  # relay.generators.main's option
LOG_TAIL_LINES = 15


class Outcome(msgspec.Struct, frozen=True):
    """How the run ended: the exit code, why, and the process that failed it ("" when none
    did: the run finished, or Ctrl-C)."""

    code: int
    reason: str
    failed: str = ""


def builtin_model(run: RunConfig) -> RunConfig:
    """Build (once, cached) each ``builtin:`` model the run names and point every model path
    that names one at it: the policy's, the critic's and the reward model's
    (``MODEL_PATH_KEYS``)."""
    for parts in MODEL_PATH_KEYS:
        path = model_path_at(run, parts)
        if path.startswith(BUILTIN_MODEL_PREFIX):
            built = built_model(path.removeprefix(BUILTIN_MODEL_PREFIX))
            run = replace_model_path(run, parts, str(built))
    return run


def built_model(name: str) -> Path:
    """The cache folder of the built-in model ``name``, built there first if missing:
    ``tiny-arith`` (the embedded default) or ``tiny-arith-tools`` (the agentic default,
    which calls a calculator; its build evaluates it with the calculator's replies)."""
    from relay.learner.tiny_model.build import build_tiny_model, build_tools_model, \
        default_model_dir

    path = default_model_dir(name)
    if (path / "config.json").is_file():
        return path
    print(f"relay launch: building the built-in model {name} into {path} (once; a few "
          "minutes)", flush=True)

    def progress(step: int, loss: float) -> None:
        if step % 50 == 0:
            print(f"\r  warm start step {step}, loss {loss:.3f}", end="", flush=True)

    if name == "tiny-arith-tools":
        from relay.generators.tools.calculator import reply_to

        tools = build_tools_model(path, reply_to, overwrite=True, on_step=progress)
        print(f"\n  built in {tools.seconds:.0f} s; held-out accuracy, sampled with its "
              f"calculator calls run: {tools.heldout.sampled.accuracy:.1%}", flush=True)
    else:
        report = build_tiny_model(path, overwrite=True, on_step=progress)
        print(f"\n  built in {report.seconds:.0f} s; held-out accuracy "
              f"{report.heldout_accuracy:.1%}", flush=True)
    return path


class Running(msgspec.Struct):
    """A started process of the plan: its spec, its handle from the backend, its log, and
    how many times it was started again (a generator: ``max_restarts``)."""

    spec: ProcessSpec
    process: ProcessHandle
    log: Path
    restarts: int = 0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: .*)?")
"""The last line of a Python traceback: ``ValueError: ...``, ``KeyboardInterrupt``."""
RANK_PREFIX = re.compile(r"^\[[^\]]*\]:? ?")
"""What torchrun may put before a rank's lines (``[rank0]:``)."""
LAUNCHER_EXCEPTIONS = ("torch.distributed.elastic.", "ChildFailedError")
"""Exceptions that report another process's failure (torchrun's), not the cause."""


def last_exception(path: Path) -> str:
    """The final line of the last Python traceback in the log at ``path`` that is not
    torchrun reporting a failed child, or "" when there is none."""
    found, in_traceback = "", False
    try:
        with open(path, errors="replace") as f:
            for line in f:
                text = RANK_PREFIX.sub("", line.rstrip("\n"))
                if text.startswith("Traceback (most recent call last)"):
                    in_traceback = True
                elif in_traceback and not text.startswith((" ", "\t")):
                    in_traceback = False
                    caused_here = not text.startswith(LAUNCHER_EXCEPTIONS)
                    if caused_here and EXCEPTION_LINE.fullmatch(text):
                        found = text
    except OSError:
        return ""
    return found


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def stop_all(processes: list[Running]) -> None:
    """SIGTERM every live process group but the buffer's and the reward servers' and wait,
    then theirs (``LAST_WAVE``) and wait (each wave at most ``STOP_GRACE_S``), then SIGKILL
    every group and wait (at most
    ``KILLED_GONE_S``) until no member of any is alive. A SIGINT or SIGTERM meanwhile (an
    impatient operator) goes straight to the SIGKILL sweep."""
    hurry = threading.Event()
    previous = _catch_signals(hurry)
    try:
        waves = ([p for p in processes if p.spec.role not in LAST_WAVE],
                 [p for p in processes if p.spec.role in LAST_WAVE])
        for wave in waves:
            for proc in wave:
                if proc.process.poll() is None:
                    proc.process.signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while not hurry.is_set() and time.monotonic() < deadline and \
                    any(p.process.poll() is None for p in wave):
                time.sleep(0.1)
        for proc in processes:
            proc.process.signal(signal.SIGKILL)  # the group may hold children of an exited leader
            if proc.process.poll() is None:
                proc.process.wait()
        deadline = time.monotonic() + KILLED_GONE_S
        while time.monotonic() < deadline and any(p.process.group_alive() for p in processes):
            time.sleep(0.02)  # a killed child of a leader can take a moment to die
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _catch_signals(caught: threading.Event) -> dict[int, object]:
    """SIGINT and SIGTERM set ``caught`` instead of raising; the handlers they replace (none
    outside the main thread, where signals cannot be caught)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda _signum, _frame: caught.set())
            for sig in (signal.SIGINT, signal.SIGTERM)}


class Supervisor:
    """Starts the plan and decides when and how the run ends."""

    def __init__(self, resolved: ResolvedLaunch, topology: Topology, run: RunConfig,
                 backend: Backend) -> None:
        self.resolved, self.topology, self.run = resolved, topology, run
        self.backend = backend
        self.run_dir = resolved.run_dir
        self.log_dir = self.run_dir / "logs"
        self.processes: list[Running] = []
        self.replaced: list[Running] = []  # dead processes started again: swept at the stop
        self.restart_due: dict[str, float] = {}  # generator name -> when to start it again
        # generator name -> its lineage: the same token for all its processes in this launch
        self.lineages = {gen.name: secrets.token_hex(16) for gen in topology.generators}
        self.board = StatusBoard(total_steps=run.trainer.total_training_steps,
                                 interactive=sys.stdout.isatty())

    def execute(self) -> Outcome:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        context = RunContext(run_dir=self.run_dir, topology=self.topology, run=self.run)
        metrics = Puller(context.metrics_endpoint, bind=True, keys=context.server_keys())
        try:
            plan = self.backend.plan(self.topology, self.run, self.run_dir)
            for spec in plan:
                self.processes.append(self._start(spec))
            self.board.generators = sum(spec.role == "generator" for spec in plan)
            print(f"relay launch: run directory {self.run_dir}", flush=True)
            return self._watch(metrics)
        except KeyboardInterrupt:
            return Outcome(code=130, reason="interrupted (Ctrl-C or SIGTERM); stopped every "
                                            "process")
        except PlacementError as exc:
            return Outcome(code=2, reason=str(exc), failed="placement")
        finally:
            stop_all(self.processes + self.replaced)  # a dead leader's children too
            self.board.finish()
            metrics.close()

    def _start(self, spec: ProcessSpec, restarts: int = 0) -> Running:
        """Start ``spec``; a topology generator with ``--lineage`` and its token, so that
        the buffer lets each of its restarts take its name at once."""
        if spec.role == "generator" and spec.name in self.lineages:
            spec = msgspec.structs.replace(spec, argv=with_lineage(spec.argv,
                                                                   self.lineages[spec.name]))
        log = self.log_dir / f"{spec.name}.log"
        return Running(spec=spec, process=self.backend.start(spec, self.topology, log), log=log,
                       restarts=restarts)

    def _generator_died(self, proc: Running, code: int, now: float) -> None:
        """Say that a generator died and, while it has restarts left (``max_restarts``),
        when it starts again: after ``RESTART_BACKOFF_S``, doubled at each restart."""
        cause = last_exception(proc.log)  # e.g. a rollout workflow that raised
        allowed = max_restarts(self.topology, proc.spec.name)
        what = f"generator {proc.spec.name} died ({describe_exit(code)}" + \
            (f", raising {cause}" if cause else "") + ")"
        if proc.restarts < allowed:
            delay = min(RESTART_BACKOFF_S * 2 ** proc.restarts, RESTART_BACKOFF_MAX_S)
            self.restart_due[proc.spec.name] = now + delay
            self.board.note(f"{what}; starting it again in {delay:g} s (restart "
                            f"{proc.restarts + 1} of {allowed}); training goes on. "
                            f"Log: {proc.log}")
        else:
            self.board.note(f"{what}{'; no restarts left' if allowed else ''}; training goes "
                            f"on without it. Log: {proc.log}")

    def _restart_due(self, now: float, reported_dead: set[str]) -> None:
        """Start again each generator whose restart is due: its spec as started, under its
        name and lineage (``--lineage``), so that it takes its dead process's name at once."""
        for name, due in list(self.restart_due.items()):
            if now < due:
                continue
            del self.restart_due[name]
            index = next(i for i, p in enumerate(self.processes) if p.spec.name == name)
            dead = self.processes[index]
            try:
                restarted = self._start(dead.spec, restarts=dead.restarts + 1)
            except PlacementError as exc:
                self.board.note(f"generator {name} could not be started again ({exc}); "
                                "training goes on without it")
                continue
            self.replaced.append(dead)
            self.processes[index] = restarted
            reported_dead.discard(name)
            self.board.note(f"generator {name} started again (restart {dead.restarts + 1})")

    def _watch(self, metrics: Puller) -> Outcome:
        learner_done_at: float | None = None
        no_generator_since: float | None = None
        reported_dead: set[str] = set()
        watchdog = ProgressWatchdog(self.run.trainer.progress_timeout_s,
                                    batch_groups=self.run.data.train_batch_size,
                                    started=time.monotonic())
        while True:
            received = metrics.receive_from(0.25)
            while received is not None:
                if isinstance(received.message, Metrics):
                    self.board.update(received.message, key=received.key)
                received = metrics.receive_from(0.0)
            self.board.render()
            now = time.monotonic()
            for proc in self.processes:
                code = proc.process.poll()
                if code is None or proc.spec.name in reported_dead:
                    continue
                reported_dead.add(proc.spec.name)
                if proc.spec.role == "learner" and code == 0:  # done when every rank is
                    if all(p.process.poll() == 0 for p in self.processes
                           if p.spec.role == "learner"):
                        learner_done_at = learner_done_at or now
                elif proc.spec.essential and learner_done_at is None and (
                        code != 0 or self.board.step < self.run.trainer.total_training_steps):
                    return self._died(proc, code)  # exit code 0 too, unless the run is over
                elif proc.spec.role == "generator" and code != 0 and learner_done_at is None:
                    self._generator_died(proc, code, now)
                elif proc.spec.role == "evaluator" and code != 0 and learner_done_at is None:
                    self.board.note(f"the evaluator died ({describe_exit(code)}); training "
                                    f"goes on WITHOUT held-out evaluation. Log: {proc.log}\n"
                                    f"{log_tail(proc.log)}")
            if learner_done_at is not None:  # reward servers serve until stopped
                if all(p.process.poll() is not None for p in self.processes
                       if p.spec.role != "reward_model") or \
                        now - learner_done_at > FINISH_GRACE_S:
                    return Outcome(code=0, reason=f"trained {self.run.trainer.total_training_steps}"
                                                  f" steps; results in {self.run_dir}")
                continue
            stuck = watchdog.stuck(self.board, now)
            if stuck is not None:
                learner = next(p for p in self.processes if p.spec.role == "learner")
                return Outcome(code=1, reason=f"{stuck}. Last lines of {learner.log}:\n"
                                              f"{log_tail(learner.log)}",
                               failed=f"stalled ({learner.spec.name} made no step within "
                                      "trainer.progress_timeout_s)")
            self._restart_due(now, reported_dead)
            alive = [p for p in self.processes if p.spec.role == "generator"
                     and p.process.poll() is None]
            attached = self.board.generators_attached()
            if alive or attached or self.restart_due:
                no_generator_since = None
            else:
                no_generator_since = no_generator_since or now
                if now - no_generator_since > NO_GENERATOR_GRACE_S:
                    return Outcome(code=1, reason="every generator has died and none attached "
                                                  f"for {NO_GENERATOR_GRACE_S:.0f} s; logs in "
                                                  f"{self.run_dir / 'logs'}",
                                   failed="every generator died")

    def _died(self, proc: Running, code: int) -> Outcome:
        tail = log_tail(proc.log)
        how = (f"exited ({describe_exit(code)}) before the learner finished" if code == 0
               else f"died: {describe_exit(code)}")
        cause = last_exception(proc.log)
        if cause:
            how += f", raising {cause}"
        return Outcome(code=1, reason=f"essential process {proc.spec.name} ({proc.spec.role}) "
                                      f"{how}. Last lines of {proc.log}:\n{tail}",
                       failed=f"{proc.spec.name} ({proc.spec.role}) "
                              f"{'exited early' if code == 0 else describe_exit(code)}")


def launch(resolved: ResolvedLaunch) -> int:
    """Run the launch to its end; returns the launcher's exit code."""
    run = builtin_model(resolved.run)
    backend = backend_for(resolved.topology)
    try:
        topology = backend.place(resolved.topology, run)
    except PlacementError as exc:
        backend.close()
        print(f"relay launch: {exc}", file=sys.stderr, flush=True)
        return 2
    topology = write_resolved(topology, run, resolved.run_dir)
    supervisor = Supervisor(resolved, topology, run, backend)
    # SIGINT too: a launcher started in the background by a script inherits SIGINT ignored,
    # and an operator's `kill -INT` must still stop the run
    previous = {sig: signal.signal(sig, _raise_interrupt)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        outcome = supervisor.execute()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        backend.close()
        if topology.security.sockets_dir != resolved.topology.security.sockets_dir:
            remove_sockets(Path(topology.security.sockets_dir),  # private_sockets made it
                           socket_names(topology))
    stream = sys.stdout if outcome.code == 0 else sys.stderr
    print(f"relay launch: {outcome.reason}", file=stream, flush=True)
    print(summary(supervisor.board, code=outcome.code, failed=outcome.failed,
                  run_dir=resolved.run_dir, tracking_uri=run.tracking.uri,
                  evaluates=run.evaluates), file=stream, flush=True)
    return outcome.code


def max_restarts(topology: Topology, name: str) -> int:
    """How many times the topology's generator ``name`` may be started again."""
    return next((g.max_restarts for g in topology.generators if g.name == name), 0)


def with_lineage(argv: list[str], token: str) -> list[str]:
    """A generator's command line with ``--lineage token`` last, once
    (``relay.generators.main``)."""
    if LINEAGE in argv:
        at = argv.index(LINEAGE)
        argv = argv[:at] + argv[at + 2:]
    return [*argv, LINEAGE, token]


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt
