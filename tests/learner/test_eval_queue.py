"""relay.learner.eval_queue: offers wait in order for the evaluator, a lost reply is handed out
again, a report is kept once, too many waiting offers skip the oldest, and the end of the
run waits for the last report and for the evaluator to hear that the run is over. A forged
request (an ``after_step`` never handed out, a report of a step not handed out yet) takes
nothing out of the queue and shadows no real report."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from relay.learner.eval_queue import EvalQueue
from relay.transport.messages import (
    ErrorReply,
    EvalOffer,
    EvalReport,
    EvalRequest,
    Shutdown,
    WeightManifest,
)

LONG_WAIT_S = 30.0  # an end() wait that a test must never sit through


def offer(step: int, version: int | None = None) -> EvalOffer:
    """The version published after ``step`` (the initial checkpoint at step 0)."""
    if step == 0:
        return EvalOffer(step=0, version=0)
    return EvalOffer(step=step, version=step if version is None else version)


def ask(queue: EvalQueue, after_step: int, report: EvalReport | None = None):
    return queue.handle(EvalRequest(after_step=after_step, report=report), current_version=7)


def until_ending(queue: EvalQueue) -> None:
    """Until ``queue.end`` has begun in another thread (however slowly it was scheduled)."""
    deadline = time.monotonic() + LONG_WAIT_S
    while not queue._over:
        assert time.monotonic() < deadline, "end() never began"
        time.sleep(0.01)


def report(step: int) -> EvalReport:
    return EvalReport(step=step, version=step, metrics={"eval/accuracy": step / 100})


def test_nothing_waiting_means_nothing_newer() -> None:
    assert ask(EvalQueue(), -1) == WeightManifest(version=7, step=-1)


def test_offers_are_handed_out_oldest_first_by_version_and_step() -> None:
    queue = EvalQueue()
    for step in (0, 10, 20):
        queue.offer(offer(step))
    assert ask(queue, -1) == WeightManifest(version=0, step=0)  # the initial checkpoint
    assert ask(queue, 0, report(0)) == WeightManifest(version=10, step=10)  # no buckets:
    # the weights went by on the stream
    assert ask(queue, 10, report(10)).step == 20
    assert ask(queue, 20, report(20)) == WeightManifest(version=7, step=20)
    assert [r.step for r in queue.take_reports()] == [0, 10, 20]
    assert queue.take_reports() == []


def test_a_reply_lost_to_a_timeout_is_handed_out_again_and_a_resent_report_kept_once() -> None:
    queue = EvalQueue()
    queue.offer(offer(10))
    assert ask(queue, -1).step == 10
    assert ask(queue, -1).step == 10  # the evaluator never got it: asks again
    ask(queue, 10, report(10))
    ask(queue, 10, report(10))  # its reply was lost: the report comes again
    assert queue.take_reports() == [report(10)]


def test_past_max_waiting_the_oldest_offer_of_trained_weights_is_skipped(
        caplog: pytest.LogCaptureFixture) -> None:
    queue = EvalQueue(max_waiting=2)
    with caplog.at_level(logging.WARNING, logger="relay.learner.eval_queue"):
        for step in (0, 10, 20, 30):
            queue.offer(offer(step))
    assert "step 10 will not be evaluated" in caplog.text
    handed, after = [], -1
    while True:
        reply = ask(queue, after)
        if reply.step == after:
            break
        after = reply.step
        handed.append(after)
    assert handed == [0, 20, 30]  # the free initial checkpoint is never skipped


def test_end_waits_for_the_last_report_and_says_goodbye() -> None:
    queue = EvalQueue()
    queue.offer(offer(10))
    ask(queue, -1)
    logged: list[EvalReport] = []
    ended: list[list[EvalReport]] = []
    waiter = threading.Thread(target=lambda: ended.append(
        queue.end(10, min_wait_s=LONG_WAIT_S, on_report=logged.append)))
    began = time.monotonic()
    waiter.start()
    until_ending(queue)
    time.sleep(0.1)
    assert waiter.is_alive()  # step 10 not reported yet
    assert ask(queue, 10, report(10)) == Shutdown(reason="the run is over")
    waiter.join(LONG_WAIT_S)
    assert not waiter.is_alive() and time.monotonic() - began < LONG_WAIT_S / 2
    assert ended == [[report(10)]] and logged == [report(10)]


def test_end_returns_at_once_when_the_last_report_was_already_taken() -> None:
    queue = EvalQueue()
    queue.offer(offer(0))
    ask(queue, -1)
    ask(queue, 0, report(0))
    assert queue.take_reports() == [report(0)]  # the loop logged it already
    waiter = threading.Thread(target=lambda: queue.end(0, min_wait_s=LONG_WAIT_S))
    began = time.monotonic()
    waiter.start()
    until_ending(queue)
    assert ask(queue, 0) == Shutdown(reason="the run is over")
    waiter.join(LONG_WAIT_S)
    assert time.monotonic() - began < LONG_WAIT_S / 2


def test_end_gives_up_after_its_budget_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    queue = EvalQueue()
    queue.offer(offer(10))
    with caplog.at_level(logging.WARNING, logger="relay.learner.eval_queue"):
        assert queue.end(10, min_wait_s=0.2) == []  # nobody came
    assert "no evaluation of step 10 arrived" in caplog.text
    assert ask(queue, -1).step == 10  # what was offered is still handed out
    assert ask(queue, 10) == Shutdown(reason="the run is over")


def test_verls_at_names_are_kept() -> None:
    queue = EvalQueue()
    queue.offer(offer(10))
    ask(queue, -1)
    verl = EvalReport(step=10, version=10, metrics={"val-core/src/acc/mean@4": 0.5})
    ask(queue, 10, verl)
    assert queue.take_reports() == [verl]


@pytest.mark.parametrize("bad", [
    EvalReport(step=2**63, version=0, metrics={"eval/accuracy": 1.0}),
    EvalReport(step=-5, version=0, metrics={"eval/accuracy": 1.0}),
    EvalReport(step=10, version=0, metrics={"eval/" + "x" * 300: 1.0}),
    EvalReport(step=10, version=0, metrics={"eval/accuracy\n": 1.0}),
])
def test_a_report_of_no_offered_step_or_with_a_name_mlflow_refuses_is_dropped(
        bad: EvalReport, caplog: pytest.LogCaptureFixture) -> None:
    queue = EvalQueue()
    queue.offer(offer(10))
    with caplog.at_level(logging.WARNING, logger="relay.learner.eval_queue"):
        assert ask(queue, -1, bad).step == 10  # answered as if no report came
    assert queue.take_reports() == []
    assert "dropped an evaluation report" in caplog.text
    ask(queue, 10, report(10))  # the real one is still kept
    assert queue.take_reports() == [report(10)]


def test_waiting_for_the_evaluator_ends_at_its_first_request() -> None:
    queue = EvalQueue()
    assert not queue.wait_for_evaluator(timeout_s=0.05)
    threading.Timer(0.1, queue.handle, (EvalRequest(after_step=-1), 0)).start()
    began = time.monotonic()
    assert queue.wait_for_evaluator(timeout_s=10.0)
    assert time.monotonic() - began < 5.0


def evaluate_all(queue: EvalQueue) -> list[int]:
    """The honest evaluator: asks, reports each step it was handed, until nothing is new."""
    handed, after, last = [], -1, None
    while True:
        reply = ask(queue, after, last)
        assert isinstance(reply, WeightManifest), reply
        if reply.step == after:
            return handed
        after, last = reply.step, report(reply.step)
        handed.append(after)


def test_a_request_after_a_step_never_handed_out_is_refused_and_drops_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    queue = EvalQueue()
    for step in (0, 10, 20):
        queue.offer(offer(step))
    with caplog.at_level(logging.WARNING, logger="relay.learner.eval_queue"):
        for forged in (10**9, 0):  # 0 was offered, but not handed out yet
            reply = ask(queue, forged)
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
            assert f"after_step {forged} would skip step 0" in reply.detail
    assert "refused an EvalRequest after step 1000000000" in caplog.text
    assert not queue.wait_for_evaluator(timeout_s=0.0)  # no evaluator has asked yet
    assert ask(queue, -1).step == 0
    reply = ask(queue, 10**9)  # the evaluator was handed step 0, but not step 10
    assert isinstance(reply, ErrorReply) and "would skip step 10" in reply.detail
    assert evaluate_all(queue) == [0, 10, 20]
    assert [r.step for r in queue.take_reports()] == [0, 10, 20]


def test_a_forged_report_of_a_step_not_handed_out_shadows_no_real_report() -> None:
    queue = EvalQueue()
    for step in (0, 10, 20):
        queue.offer(offer(step))
    assert ask(queue, -1).step == 0
    forged = EvalReport(step=20, version=20, metrics={"eval/accuracy": 12345.0})
    assert ask(queue, -1, forged).step == 0  # dropped: step 20 was not handed out
    assert ask(queue, 0, report(0)).step == 10
    assert ask(queue, 10, report(10)).step == 20
    ask(queue, 20, report(20))
    assert queue.take_reports() == [report(0), report(10), report(20)]
