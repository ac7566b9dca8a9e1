"""The launcher's live status line, built from the metrics the processes push.

Interactive terminals get one line rewritten in place; logs (no tty) get the same line
every ``LOG_EVERY_S`` seconds. Notes (a generator died...) always get a line of their own.
Any process on the metrics address may send anything a ``Metrics`` message can hold, so
every value is shown through ``count`` or ``number``: NaN, infinities and absurd magnitudes
read as "?" and never raise; a learner step outside the run's steps is no step of this run
and is ignored, values and all (one would otherwise freeze the step the watchdog waits past).
"""

from __future__ import annotations

import math
import sys
import time

from transport.messages import Metrics

LOG_EVERY_S = 10.0
RENDER_EVERY_S = 0.5
MAX_SHOWN = 1e15  # larger magnitudes are no metric of a real run: shown as "?"


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

    def update(self, message: Metrics) -> None:
        if message.source == "learner" and 0 <= message.step <= self.total_steps:
            self.step = max(self.step, message.step)
            self.learner.update(message.values)
        elif message.source == "buffer":
            self.buffer.update(message.values)

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
