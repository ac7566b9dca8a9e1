"""The progress watchdog: a run that makes no learner step for too long is ended.

Processes can be alive and still make no progress: a learner waiting forever for batches
nobody makes, a buffer that leases nothing, a collective that never returns. The launcher
sees every learner step (the learner's ``Metrics``) and the buffer's gauges (the buffer's
``Metrics``), so it can tell how long the learner has gone without a step and guess from
the gauges which stage holds the run up:

- no generator attached: nothing generates;
- generators attached, fewer groups stored than a batch: generation does not keep up or
  leases are gated (staleness bound, weights not arriving);
- a batch's worth stored: the learner itself is stuck (an update or a collective).

``trainer.progress_timeout_s`` (0: never) bounds the wait, counted from the launch until
the first step (model loading and the first batch included) and from each step after.
"""

from __future__ import annotations

from relay.launcher.status import StatusBoard, count


class ProgressWatchdog:
    """Knows when the learner last stepped and names the stuck stage past the timeout."""

    def __init__(self, timeout_s: float, batch_groups: int, started: float) -> None:
        self.timeout_s, self.batch_groups = timeout_s, batch_groups
        self._step, self._since = -1, started

    def stuck(self, board: StatusBoard, now: float) -> str | None:
        """None while the run progresses; past the timeout, what holds it up."""
        if board.step != self._step:
            self._step, self._since = board.step, now
            return None
        waited = now - self._since
        if self.timeout_s <= 0 or waited <= self.timeout_s:
            return None
        what = "its first step" if board.step == 0 else f"a step after step {board.step}"
        return (f"no learner step for {waited:.0f} s (trainer.progress_timeout_s = "
                f"{self.timeout_s:g}) waiting for {what}: {self.stage(board)}")

    def stage(self, board: StatusBoard) -> str:
        """The stage that most likely holds the run up, from the buffer's last gauges."""
        buffer = board.buffer
        if not buffer:
            return "the buffer has reported nothing (is it serving?)"
        generators = board.generators_attached()
        stored = count(buffer.get("buffer/occupancy", 0.0))
        if generators == 0:
            return "no generator is attached to the buffer"
        if stored < self.batch_groups:
            rate = buffer.get("buffer/generator_tokens_per_s", 0.0)
            gated = count(buffer.get("buffer/leases/gated", 0.0))
            return (f"generation: the buffer holds {stored} of the {self.batch_groups} groups "
                    f"a batch needs; {generators} generator(s) attached making "
                    f"{rate:.0f} tokens/s, {gated} lease requests gated so far by the "
                    "staleness bound")
        return (f"the learner: the buffer holds {stored} groups, enough for a batch, so the "
                "learner's update or a collective is stuck (see its log)")

