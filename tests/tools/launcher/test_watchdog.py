"""relay.launcher.watchdog: a run without learner steps is ended, naming the stage that holds it."""

from __future__ import annotations

from relay.launcher.status import StatusBoard
from relay.launcher.watchdog import ProgressWatchdog
from relay.transport.messages import Metrics


def board(step: int = 0, **buffer: float) -> StatusBoard:
    status = StatusBoard(total_steps=100, interactive=False)
    status.update(Metrics(source="learner", step=step, values={}))
    if buffer:
        status.update(Metrics(source="buffer", step=0, values={
            f"buffer/{name.replace('__', '/')}": value for name, value in buffer.items()}))
    return status


def test_steps_keep_the_watchdog_quiet_and_silence_past_the_timeout_fires_it() -> None:
    watchdog = ProgressWatchdog(60.0, batch_groups=32, started=0.0)
    status = board(step=0, generators=1, occupancy=40)
    assert watchdog.stuck(status, now=59.0) is None
    status.update(Metrics(source="learner", step=1, values={}))
    assert watchdog.stuck(status, now=100.0) is None  # a step at 100 s restarts the clock
    assert watchdog.stuck(status, now=159.0) is None
    reason = watchdog.stuck(status, now=161.0)
    assert reason is not None and "no learner step for 61 s" in reason
    assert "after step 1" in reason and "trainer.progress_timeout_s = 60" in reason


def test_it_names_the_stage_from_the_buffer_gauges() -> None:
    watchdog = ProgressWatchdog(10.0, batch_groups=32, started=0.0)
    assert "reported nothing" in watchdog.stage(board())
    assert "no generator is attached" in watchdog.stage(board(generators=0, occupancy=0))
    slow = watchdog.stage(board(generators=2, occupancy=5, generator_tokens_per_s=12.0,
                                leases__gated=7))
    assert slow.startswith("generation") and "5 of the 32 groups" in slow and "7 lease" in slow
    assert watchdog.stage(board(generators=1, occupancy=32)).startswith("the learner")


def test_a_timeout_of_zero_never_fires_and_nan_gauges_do_not_crash_it() -> None:
    assert ProgressWatchdog(0.0, batch_groups=1, started=0.0).stuck(board(), now=1e9) is None
    watchdog = ProgressWatchdog(10.0, batch_groups=4, started=0.0)
    assert "0 of the 4" in watchdog.stage(board(generators=1, occupancy=float("nan")))
