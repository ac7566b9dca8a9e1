"""Weights waiting for the evaluator, and the reports it sends back (thread-safe).

Held-out evaluation runs in its own process (``relay.generators.evaluator``) so that no learner
step waits for it. The loop ``offer``s each published version due for evaluation (before
any, the initial checkpoint, which the evaluator loads itself); the weights went by on the
weight stream, where an ``EvalOffer`` tells the evaluator to keep them. The weight server's
thread answers the evaluator's ``EvalRequest``s from here (``handle``), oldest offer first,
and queues the reports they carry for the loop (``take_reports``). An offer stays first in
line until the evaluator asks for something after it, so a reply lost to a timeout is
simply handed out again; a report is kept once (a resent one is ignored). Only the
evaluator's role may send ``EvalRequest``s (``WeightServer``, ``relay.transport.roles``), and a
request is still judged against what was handed out, since without CURVE that role is not
proven: an ``after_step`` that reaches an offer never handed out is refused
(``bad_request``, nothing leaves the queue), so only offers the evaluator was given can
leave it; a report
is kept only when it measured a step handed out and not yet reported, and its metric
names are ones MLflow takes (``report_problem``); others are dropped with a warning, never
handed to the learner's loop, and never shadow the report of a step still to come.

The evaluator sends its first request once it has heard the weight stream (the loop streams
``StreamBeacon``s while it waits); the loop ``wait_for_evaluator`` before it streams its
first version, or a version offered before the evaluator listened could never be evaluated
(the stream only repeats the newest).

The evaluator keeps a copy of each version waiting to be evaluated, so at most
``max_waiting`` wait: past that the oldest waiting one is skipped, with a warning (the
evaluator drops its copy the same way). At the end of the run ``end``
waits (bounded) for the last offer's report and for the evaluator to hear that the run is
over.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable

from relay.transport.messages import (
    ErrorReply,
    EvalOffer,
    EvalReport,
    EvalRequest,
    Message,
    Shutdown,
    WeightManifest,
)

logger = logging.getLogger(__name__)

GOODBYE_GRACE_S = 3.0  # after the last report: time for the evaluator's next request
METRIC_NAME = re.compile(r"[\w./\- :@]{1,250}")
"""A metric name MLflow takes: at most 250 letters, digits, ``_ - . / :`` and spaces; and
``@`` (verl's ``mean@4``), which the tracker spells ``_at_`` for MLflow."""


def report_problem(report: EvalReport, handed_through: int) -> str:
    """Why ``report`` is no report of this run's evaluations ("" when it is): its step
    must lie between 0 and the latest step handed out to the evaluator, ``handed_through``,
    and its metric names must suit MLflow."""
    if not 0 <= report.step <= handed_through:
        return (f"step {report.step} was never handed out for evaluation (the latest is "
                f"{handed_through})")
    bad = [name for name in report.metrics if not METRIC_NAME.fullmatch(name)]
    if bad:
        return f"metric name {bad[0][:60]!r} is not one MLflow takes"
    return ""


class EvalQueue:
    def __init__(self, max_waiting: int = 2) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()  # everything below is shared by two threads
        self._waiting: deque[EvalOffer] = deque()
        self._reports: list[EvalReport] = []
        self._reported_through = -1  # the latest step a report measured
        self._handed_through = -1  # the latest step handed out to the evaluator
        self._handed_at = 0.0
        self._longest_s = 0.0  # the longest evaluation so far
        self._over = False
        self._goodbye_said = False
        self._evaluator_joined = threading.Event()  # its first request arrived

    # -- the learner's loop --------------------------------------------------------------

    def offer(self, offer: EvalOffer) -> None:
        """Queue ``offer``; the oldest offer of trained weights goes when too many wait."""
        with self._lock:
            self._waiting.append(offer)
            holding = [o for o in self._waiting if o.version > 0]
            for skipped in holding[:max(0, len(holding) - self.max_waiting)]:
                self._waiting.remove(skipped)
                logger.warning("the evaluator is behind: step %d will not be evaluated "
                               "(trainer.max_waiting_evals = %d)", skipped.step,
                               self.max_waiting)

    def wait_for_evaluator(self, timeout_s: float) -> bool:
        """Block until the evaluator's first request (it listens to the weight stream from
        then on); False after ``timeout_s``."""
        return self._evaluator_joined.wait(timeout_s)

    def take_reports(self) -> list[EvalReport]:
        """The reports that arrived since the last call."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def end(self, last_step: int, min_wait_s: float = 120.0,
            on_report: Callable[[EvalReport], None] | None = None) -> list[EvalReport]:
        """No more offers: wait until the evaluator has reported ``last_step`` and heard
        that the run is over, for at most ``min_wait_s`` or three times the longest
        evaluation per waiting offer. Returns the reports that arrived meanwhile, each also
        passed to ``on_report`` as it arrives."""
        with self._lock:
            self._over = True
            budget = max(min_wait_s, 3 * self._longest_s * (len(self._waiting) + 1))
        deadline = time.monotonic() + budget
        reported_at: float | None = None
        reports: list[EvalReport] = []
        while True:
            with self._lock:
                arrived, self._reports = self._reports, []
                done, goodbye = self._reported_through >= last_step, self._goodbye_said
            for report in arrived:
                reports.append(report)
                if on_report is not None:
                    on_report(report)
            now = time.monotonic()
            if done:
                reported_at = reported_at or now
                if goodbye or now - reported_at > GOODBYE_GRACE_S:
                    return reports
            elif now > deadline:
                logger.warning("no evaluation of step %d arrived within %.0f s: is the "
                               "evaluator alive? (its log is in the run directory's logs/)",
                               last_step, budget)
                return reports
            time.sleep(0.05)

    # -- the weight server's thread ------------------------------------------------------

    def handle(self, msg: EvalRequest, current_version: int) -> Message:
        """The reply to an ``EvalRequest`` (see ``relay.transport.messages.EvalRequest``), or
        ``ErrorReply(bad_request)`` for one whose ``after_step`` would take an offer never
        handed out out of the queue."""
        now = time.monotonic()
        with self._lock:
            unhanded = next((o.step for o in self._waiting if o.step > self._handed_through),
                            None)
            if unhanded is not None and msg.after_step >= unhanded:
                logger.warning("refused an EvalRequest after step %d: step %d waits for "
                               "evaluation and was never handed out", msg.after_step, unhanded)
                return ErrorReply(code="bad_request", detail=(
                    f"after_step {msg.after_step} would skip step {unhanded}, which was never "
                    f"handed out for evaluation (the latest handed out is "
                    f"{self._handed_through})"))
            self._evaluator_joined.set()
            report = msg.report
            problem = "" if report is None else report_problem(report, self._handed_through)
            if problem:
                logger.warning("dropped an evaluation report: %s", problem)
            elif report is not None and report.step > self._reported_through:
                self._reports.append(report)
                self._reported_through = report.step
                self._longest_s = max(self._longest_s, now - self._handed_at)
            while self._waiting and self._waiting[0].step <= msg.after_step:
                self._waiting.popleft()  # evaluated (or skipped by the evaluator)
            if not self._waiting:
                if self._over:
                    self._goodbye_said = True
                    return Shutdown(reason="the run is over")
                return WeightManifest(version=current_version, step=msg.after_step)
            offer, self._handed_at = self._waiting[0], now
            self._handed_through = max(self._handed_through, offer.step)
        return WeightManifest(version=offer.version, step=offer.step)
