"""The launcher's live status, built from the metrics the processes push.

What it shows: step/total, the percentage, seconds per step, the ETA and the time since
the launch; the learner's weight version, reward, held-out accuracy, staleness, the
generation and learning rates (tokens/s), the generators attached and the groups buffered.
While no step is done it names the start-up phase instead: what the learner last announced
(``Metrics.phase``: waiting for the evaluator, for the first batch, ...) or, before it has
said anything, that it is still starting (loading its model), with the generators attached
so far out of those launched. Rates are smoothed (``Ema``), so that one quick or slow batch
does not swing the line.

Interactive terminals get a ``rich`` display redrawn in place (a progress bar over the
metrics line); logs (no tty) get the same text as one plain line every ``LOG_EVERY_S``
seconds. Notes (a generator died, the buffer's first failed rollout log write...) always
get a line of their own.

Any process on the metrics address may send anything a ``Metrics`` message can hold, so
every value is shown through ``count`` or ``number``: NaN, infinities and absurd magnitudes
read as "?" and never raise; a learner step outside the run's steps is no step of this run
and is ignored, values and all (one would otherwise freeze the step the watchdog waits past).
A message is taken only from a sender that may act as its ``source`` (``relay.transport.roles``):
under CURVE the control hosts' key for ``learner`` and ``buffer``, so a generator or
evaluator key can neither move the step the watchdog waits past nor fake the buffer's
gauges; others are counted (``refused``) and noted once per key and source.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from relay.transport.messages import Metrics
from relay.transport.roles import PeerRoles

LOG_EVERY_S = 5.0
RENDER_EVERY_S = 0.5
SMOOTHING = 0.2  # Ema's alpha: about the last 2 / alpha - 1 = 9 samples weigh in
MAX_SHOWN = 1e15  # larger magnitudes are no metric of a real run: shown as "?"
ROLLOUT_LOG_ERRORS = "buffer/rollout_log/write_errors"  # noted once, at the first
REWARD_ERRORS = "rollout/reward_error_frac"  # of the learner's batch
FAILING_REWARDS = 0.5  # a larger share of samples whose reward function failed: a warning
ACCURACY = "eval/accuracy"
SMOOTHED = {"perf/generator_tokens_per_s": "gen {} tok/s",
            "perf/learner_tokens_per_s": "learn {} tok/s"}
# before the learner says what it does: all it does before it can say anything
STARTING = "learner starting (loading its model, opening its MLflow store)"


def count(value: float) -> int:
    """A gauge as a count: 0 for anything not a finite number below ``MAX_SHOWN``."""
    return int(value) if math.isfinite(value) and abs(value) < MAX_SHOWN else 0


def number(value: float, spec: str) -> str:
    """``value`` formatted with ``spec``, or "?" when not finite or beyond ``MAX_SHOWN``."""
    return format(value, spec) if math.isfinite(value) and abs(value) < MAX_SHOWN else "?"


def rate(value: float) -> str:
    """A rate for the eye: ``950``, ``7.6k``, ``33k``, ``1.2M``; "?" as ``number``."""
    if not (math.isfinite(value) and abs(value) < MAX_SHOWN):
        return "?"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.1f}{suffix}" if abs(scaled) < 10 else f"{scaled:.0f}{suffix}"
    return f"{value:.0f}"


def clock(seconds: float) -> str:
    """``seconds`` as ``MM:SS``, or ``H:MM:SS`` from an hour; "?" when not finite."""
    if not (math.isfinite(seconds) and 0 <= seconds < MAX_SHOWN):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Ema:
    """An exponential moving average of the finite samples it is given:

        m_1 = x_1,    m_t = alpha * x_t + (1 - alpha) * m_{t-1}

    so one outlier moves it by ``alpha`` of its distance; None before the first sample.
    """

    def __init__(self, alpha: float = SMOOTHING) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"Ema: alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def add(self, sample: float) -> None:
        if not math.isfinite(sample):
            return
        self.value = sample if self.value is None else (
            self.alpha * sample + (1 - self.alpha) * self.value)


class StatusBoard:
    """The run's state as the launcher sees it, and its display (module docstring).

    ``generators`` is how many generators the launch started (0: unknown); ``now`` the
    clock (``time.monotonic``; tests pass their own)."""

    def __init__(self, total_steps: int, interactive: bool, generators: int = 0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.total_steps = total_steps
        self.interactive = interactive
        self.generators = generators
        self.learner: dict[str, float] = {}
        self.buffer: dict[str, float] = {}
        self.step = 0
        self.phase = ""  # what the learner last said it is doing ("" while it steps)
        self.accuracy: dict[int, float] = {}  # held-out accuracy by the step it measured
        self.smoothed = {key: Ema() for key in SMOOTHED}
        self.step_seconds = Ema()  # wall seconds per step, as the launcher sees them
        self._now = now
        self.started = now()
        self._timed: tuple[int, float] | None = None  # (step, when it was first seen)
        self._last_render = -math.inf
        self._live: Live | None = None
        self.refused = 0  # messages from a sender that may not act as their source
        self._roles = PeerRoles()
        self._noted: set[tuple[str, str]] = set()
        self._rollout_log_errors_noted = False
        self._rewards_failing_noted = False

    def update(self, message: Metrics, key: str = "") -> None:
        """Take ``message``, which came with the CURVE key named ``key`` ("" without
        CURVE), unless that key may not act as its ``source`` (module docstring)."""
        refusal = self._roles.may_act_as(key, message.source)
        if refusal:
            self.refused += 1
            if (key, message.source) not in self._noted:
                self._noted.add((key, message.source))
                self.note(f"ignored metrics claiming to come from the {message.source[:40]!r}"
                          f": {refusal[:200]} (noted once per key and source)")
            return
        if message.source == "learner" and 0 <= message.step <= self.total_steps:
            if message.phase or message.step > self.step:  # a late report keeps the phase
                self.phase = message.phase[:200]
            self.step = max(self.step, message.step)
            self._time_step()
            self.learner.update(message.values)
            for name, ema in self.smoothed.items():
                if name in message.values:
                    ema.add(message.values[name])
            accuracy = message.values.get(ACCURACY)
            if accuracy is not None and math.isfinite(accuracy):
                self.accuracy[message.step] = accuracy
            self._note_failing_rewards(message.step)
        elif message.source == "buffer":
            self.buffer.update(message.values)
            self._note_rollout_log_errors()

    def _time_step(self) -> None:
        """Seconds per step: the wall time between the steps the launcher sees, per step
        (from the first step seen, so the start-up is not counted), smoothed."""
        now = self._now()
        if self.step == 0:
            return
        if self._timed is None:
            self._timed = (self.step, now)
        elif self.step > self._timed[0] and now > self._timed[1]:
            last_step, last_at = self._timed
            self.step_seconds.add((now - last_at) / (self.step - last_step))
            self._timed = (self.step, now)

    def eta_s(self) -> float | None:
        """Seconds to the last step at the smoothed pace; None before a pace is known."""
        per_step = self.step_seconds.value
        return None if per_step is None else per_step * (self.total_steps - self.step)

    def _note_rollout_log_errors(self) -> None:
        """Say once that the buffer could not write its rollout log: a full disk shows
        here first, before the learner's next checkpoint fails on it."""
        errors = count(self.buffer.get(ROLLOUT_LOG_ERRORS, 0.0))
        if errors and not self._rollout_log_errors_noted:
            self._rollout_log_errors_noted = True
            self.note(f"the buffer could not write its rollout log ({errors} failed writes so "
                      "far; the first is in logs/buffer.log): is the run directory's disk "
                      "full? Training goes on, but the learner's next checkpoint may fail "
                      "and a replay will lack these groups (buffer.rollout_log_max_gb caps "
                      "the log)")

    def rewards_failing(self) -> float | None:
        """The share of the last batch's samples whose reward function failed, when more
        than ``FAILING_REWARDS`` (a broken reward function: they all score 0); else None."""
        share = self.learner.get(REWARD_ERRORS, 0.0)
        return share if math.isfinite(share) and FAILING_REWARDS < share <= 1.0 else None

    def _note_failing_rewards(self, step: int) -> None:
        """A line of its own when a batch's rewards start failing (again); the status line
        says so for as long as they do."""
        share = self.rewards_failing()
        if share is not None and not self._rewards_failing_noted:
            self.note(f"WARNING: the reward function failed on {share:.0%} of step {step}'s "
                      f"samples ({REWARD_ERRORS}), which all score 0: the generators' logs "
                      "name the most common error (\"REWARD FUNCTION FAILING\"); check "
                      "custom_reward_function")
        self._rewards_failing_noted = share is not None

    def generators_attached(self) -> int:
        return count(self.buffer.get("buffer/generators", 0.0))

    def elapsed_s(self) -> float:
        return self._now() - self.started

    def progress(self) -> str:
        """The progress part: ``step 12/400 3% | 0.21 s/step | ETA 01:22 | 00:09``, or
        while no step is done, ``starting 00:09 | <the start-up phase>``."""
        elapsed = clock(self.elapsed_s())
        if self.step == 0:
            return f"starting {elapsed} | {self.phase or STARTING}"
        per_step, eta = self.step_seconds.value, self.eta_s()
        return " | ".join([
            f"step {self.step}/{self.total_steps} {self.step / self.total_steps:.0%}",
            f"{number(per_step, '.2f') if per_step is not None else '?'} s/step",
            f"ETA {clock(eta) if eta is not None else '?'}", elapsed])

    def details(self) -> str:
        """The metrics part: version, reward, accuracy, staleness, rates, generators,
        buffered groups, and what the learner is doing when it is not stepping."""
        learner, buffer = self.learner, self.buffer
        parts = [f"v{count(learner.get('version', 0.0))}"] if self.step else []
        shown = (("rollout/reward_mean", "reward {}", ".3f"), (ACCURACY, "acc {}", ".1%"),
                 ("staleness/mean", "stale {}", ".2f"))
        parts += [text.format(number(learner[key], spec)) for key, text, spec in shown
                  if key in learner]
        parts += [SMOOTHED[key].format(rate(ema.value))
                  for key, ema in self.smoothed.items() if ema.value is not None]
        failing = self.rewards_failing()
        if failing is not None:
            parts.append(f"REWARD FN FAILING {failing:.0%}")
        attached = self.generators_attached()
        parts.append(f"generators {attached}/{self.generators}" if self.generators
                     else f"generators {attached}")
        parts.append(f"buffered {count(buffer.get('buffer/occupancy', 0.0))}")
        if self.step and self.phase:
            parts.append(self.phase)
        return " | ".join(parts)

    def line(self) -> str:
        """The whole status as one plain line (the display without a tty)."""
        return f"{self.progress()} | {self.details()}"

    def display(self) -> Group:
        """The interactive display: a progress bar with the progress part beside it, the
        metrics part under it."""
        top = Table.grid(padding=(0, 1))
        top.add_row(ProgressBar(total=self.total_steps, completed=self.step, width=30),
                    Text(self.progress()))
        return Group(top, Text(self.details(), style="dim"))

    def render(self) -> None:
        """Redraw (a tty, at most every ``RENDER_EVERY_S``) or print the line (no tty,
        every ``LOG_EVERY_S``)."""
        now = self._now()
        every = RENDER_EVERY_S if self.interactive else LOG_EVERY_S
        if now - self._last_render < every:
            return
        self._last_render = now
        if self.interactive:
            if self._live is None:
                self._live = Live(self.display(), console=Console(file=sys.stdout),
                                  auto_refresh=False, redirect_stdout=False,
                                  redirect_stderr=False)
                self._live.start()
            self._live.update(self.display(), refresh=True)
        else:
            print(self.line(), flush=True)

    def note(self, text: str) -> None:
        """A line of its own, above the display."""
        if self._live is not None:
            self._live.console.print(Text(f"relay launch: {text}"))
        else:
            print(f"relay launch: {text}", flush=True)

    def finish(self) -> None:
        """The last state, left on screen (or in the log)."""
        if self._live is not None:
            self._live.update(self.display(), refresh=True)
            self._live.stop()
            self._live = None
        elif self.step:
            print(self.line(), flush=True)
