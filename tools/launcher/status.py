"""The launcher's live status line, built from the metrics the processes push.

Interactive terminals get one line rewritten in place; logs (no tty) get the same line
every ``LOG_EVERY_S`` seconds. Notes (a generator died, the buffer's first failed rollout
log write...) always get a line of their own.
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

from relay.transport.messages import Metrics
from relay.transport.roles import PeerRoles

LOG_EVERY_S = 10.0
RENDER_EVERY_S = 0.5
MAX_SHOWN = 1e15  # larger magnitudes are no metric of a real run: shown as "?"
ROLLOUT_LOG_ERRORS = "buffer/rollout_log/write_errors"  # noted once, at the first
REWARD_ERRORS = "rollout/reward_error_frac"  # of the learner's batch
FAILING_REWARDS = 0.5  # a larger share of samples whose reward function failed: a warning


def count(value: float) -> int:
    """A gauge as a count: 0 for anything not a finite number below ``MAX_SHOWN``."""
    return int(value) if math.isfinite(value) and abs(value) < MAX_SHOWN else 0


def number(value: float, spec: str) -> str:
    """``value`` formatted with ``spec``, or "?" when not finite or beyond ``MAX_SHOWN``."""
    return format(value, spec) if math.isfinite(value) and abs(value) < MAX_SHOWN else "?"


class StatusBoard:
    def __init__(self, total_steps: int, interactive: bool) -> None:
        self.total_steps = total_steps
        self.interactive = interactive
        self.learner: dict[str, float] = {}
        self.buffer: dict[str, float] = {}
        self.step = 0
        self.started = time.monotonic()
        self._last_render = 0.0
        self._width = 0
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
            self.step = max(self.step, message.step)
            self.learner.update(message.values)
            self._note_failing_rewards(message.step)
        elif message.source == "buffer":
            self.buffer.update(message.values)
            self._note_rollout_log_errors()

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

    def line(self) -> str:
        learner, buffer = self.learner, self.buffer
        minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
        parts = [f"{minutes:02d}:{seconds:02d}", f"step {self.step}/{self.total_steps}",
                 f"v{count(learner.get('version', 0.0))}"]
        shown = (("rollout/reward_mean", "reward {}", ".3f"), ("eval/accuracy", "acc {}", ".1%"),
                 ("staleness/mean", "stale {}", ".2f"),
                 ("perf/generator_tokens_per_s", "gen {} tok/s", ".0f"),
                 ("perf/learner_tokens_per_s", "learn {} tok/s", ".0f"))
        parts += [text.format(number(learner[key], spec)) for key, text, spec in shown
                  if key in learner]
        failing = self.rewards_failing()
        if failing is not None:
            parts.append(f"REWARD FN FAILING {failing:.0%}")
        parts.append(f"generators {self.generators_attached()}")
        parts.append(f"buffered {count(buffer.get('buffer/occupancy', 0.0))}")
        return " | ".join(parts)

    def render(self) -> None:
        now = time.monotonic()
        every = RENDER_EVERY_S if self.interactive else LOG_EVERY_S
        if now - self._last_render < every:
            return
        self._last_render = now
        text = self.line()
        if self.interactive:
            sys.stdout.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def note(self, text: str) -> None:
        if self.interactive and self._width:
            sys.stdout.write("\n")
            self._width = 0
        print(f"launch-cluster: {text}", flush=True)

    def finish(self) -> None:
        if self.interactive and self._width:
            sys.stdout.write("\r" + self.line().ljust(self._width) + "\n")
        elif self.step:
            sys.stdout.write(self.line() + "\n")
        sys.stdout.flush()
