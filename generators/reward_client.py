"""A generator's side of the reward servers (``[[reward_models]]``): scores over the wire.

``RemoteRewardModel.score`` and ``RemoteJudge.judge`` take what the in-process
``RewardModelScorer.score`` and ``EngineJudge.judge`` take and give what they give, so the
sender (``relay.generators.sender``) scores a group the same way wherever the model runs.
Each call is one ``ScoreRequest`` holding the prompt's responses (one batch on the server),
named by a fresh ``request_id``; the reply must name that id and the item's id and carry
one score per response, else ``ScoreMismatch``: a score never lands on another sample.

``ScoreClients`` spreads the requests over the servers round-robin, one request in flight
(the sender's thread is its only caller). A server that does not answer within its
``timeout_s`` is logged, and the request goes to the next server (the same one when there
is one) after a pause that doubles from one second up to ten, until
``buffer.client_patience_s`` has passed since the first try; then ``RewardServerGone`` is
raised. Scoring is pure, so a retried request is safe. A refusal (``ErrorReply``: a
malformed request, a scorer the server does not hold, a model that failed) raises
``RemoteError`` at once. Either way the sender's thread fails, the generator's compute loop
raises it (``GroupSender.raise_if_failed``) and the generator dies loudly, naming the
server, to be started again by the launcher (``max_restarts``): a sample is never scored 0
for a server's silence.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from relay.configs.run_schema import RewardCombine, RewardModelConfig
from relay.generators.judge import Verdict
from relay.transport.messages import (
    ErrorReply,
    ScoreItem,
    ScoreKind,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
)
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client, PeerTimeout, RemoteError

logger = logging.getLogger(__name__)

FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 10.0


class RewardServerGone(PeerTimeout):
    """No reward server answered a request, retried over every server, for the whole
    patience."""

    def __init__(self, endpoints: Sequence[str], patience_s: float, tries: int) -> None:
        TimeoutError.__init__(
            self, f"no reward server answered a ScoreRequest in {patience_s:g} s ({tries} "
                  f"tries over {', '.join(endpoints)}): are the [[reward_models]] processes "
                  "running (their logs in RUN_DIR/logs/), or is each reply slower than its "
                  "timeout_s?")
        self.endpoint, self.request, self.timeout_s = ", ".join(endpoints), "ScoreRequest", \
            patience_s


class ScoreMismatch(RemoteError):
    """A reply that does not answer the request it came for (another id, another item, a
    score count that is not the response count)."""


class ScoreClients:
    """One ``Client`` per reward server, used round-robin from one thread (module
    docstring). ``timeout_s``: a reply's wait, one for every server or one per server;
    ``patience_s``: the whole request's."""

    def __init__(self, endpoints: Sequence[str], *, keys: ClientKeys | None,
                 timeout_s: float | Sequence[float], patience_s: float,
                 first_pause_s: float = FIRST_PAUSE_S) -> None:
        if not endpoints:
            raise ValueError("ScoreClients needs at least one reward server endpoint")
        self.endpoints = list(endpoints)
        timeouts = [timeout_s] * len(endpoints) if isinstance(timeout_s, (int, float)) \
            else list(timeout_s)
        if len(timeouts) != len(self.endpoints):
            raise ValueError(f"{len(timeouts)} timeouts for {len(self.endpoints)} servers")
        self.timeouts_s, self.patience_s = timeouts, patience_s
        self.first_pause_s = first_pause_s
        self._clients = [Client(e, keys=keys) for e in self.endpoints]
        self._next = itertools.cycle(range(len(self._clients)))
        self._owner: threading.Thread | None = None
        self.served = [0] * len(self._clients)  # replies taken from each server

    def request(self, kind: ScoreKind, item: ScoreItem) -> ScoreResult:
        """The server's result for ``item``, checked against the request (module
        docstring)."""
        self._check_thread()
        request = ScoreRequest(request_id=secrets.token_hex(8), kind=kind, items=[item])
        began, pause, tries = time.monotonic(), self.first_pause_s, 0
        while True:
            index = next(self._next)
            client, tries = self._clients[index], tries + 1
            try:
                reply = client.request(request, self.timeouts_s[index])
            except PeerTimeout:
                waited = time.monotonic() - began
                if waited + pause >= self.patience_s:
                    raise RewardServerGone(self.endpoints, self.patience_s, tries) from None
                logger.warning("reward server %s did not answer a %s request within %g s; "
                               "asking %s in %.0f s (giving up after %.0f s)", client.endpoint,
                               kind, self.timeouts_s[index],
                               self._clients[(index + 1) % len(self._clients)].endpoint,
                               pause, self.patience_s)
                time.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)
                continue
            self.served[index] += 1
            return checked_result(client.endpoint, request, reply)

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def _check_thread(self) -> None:
        """A ZeroMQ socket belongs to one thread: the first caller's."""
        current = threading.current_thread()
        if self._owner is None:
            self._owner = current
        elif self._owner is not current:
            raise RuntimeError(f"ScoreClients is used by thread {current.name!r} but belongs "
                               f"to {self._owner.name!r}: give each thread its own")


def checked_result(endpoint: str, request: ScoreRequest, reply: Any) -> ScoreResult:
    """The single result of ``reply`` to ``request`` (one item), or ``RemoteError`` for a
    refusal and ``ScoreMismatch`` for a reply to something else."""
    if isinstance(reply, ErrorReply):
        raise RemoteError(endpoint, reply.code, reply.detail)
    if not isinstance(reply, ScoreReply):
        raise ScoreMismatch(endpoint, "unexpected_reply",
                            f"expected ScoreReply, got {type(reply).__name__}")
    if reply.request_id != request.request_id:
        raise ScoreMismatch(endpoint, "mismatched_reply",
                            f"reply to request {reply.request_id!r}, not "
                            f"{request.request_id!r}")
    (item,) = request.items
    if [r.item_id for r in reply.results] != [item.item_id]:
        raise ScoreMismatch(endpoint, "mismatched_reply",
                            f"results for {[r.item_id for r in reply.results]}, not "
                            f"[{item.item_id!r}]")
    result = reply.results[0]
    expected = max(len(item.responses), len(item.texts))
    if len(result.scores) != expected or (result.errors and len(result.errors) != expected):
        raise ScoreMismatch(endpoint, "mismatched_reply",
                            f"{len(result.scores)} scores and {len(result.errors)} errors for "
                            f"{expected} responses of {item.item_id!r}")
    return result


class RemoteRewardModel:
    """``reward_model.enable`` scored by the reward servers; ``config`` is the run's
    ``reward_model`` (the sender reads ``config.combine``)."""

    def __init__(self, config: RewardModelConfig, clients: ScoreClients) -> None:
        self.config, self.clients = config, clients

    def score(self, messages: list[dict[str, Any]], prompt_ids: Sequence[int],
              responses: Sequence[Sequence[int]], texts: Sequence[str]) -> list[float]:
        """The reward model's score of each response (as ``RewardModelScorer.score``)."""
        item = ScoreItem(item_id=secrets.token_hex(4), messages=list(messages),
                         prompt_ids=list(prompt_ids), responses=[list(r) for r in responses],
                         texts=list(texts))
        return self.clients.request("reward_model", item).scores


class RemoteJudge:
    """``reward_model.judge`` asked through the reward servers; its score meets the rule's
    as ``combine`` says."""

    def __init__(self, combine: RewardCombine, clients: ScoreClients) -> None:
        self.combine, self.clients = combine, clients

    def judge(self, messages: Sequence[dict[str, Any]], texts: Sequence[str],
              ground_truth: Any) -> list[Verdict]:
        """One verdict per response (as ``EngineJudge.judge``; the judge's raw answers stay
        on the server)."""
        item = ScoreItem(item_id=secrets.token_hex(4), messages=list(messages),
                         texts=list(texts), ground_truth=ground_truth)
        result = self.clients.request("judge", item)
        errors = result.errors or [""] * len(result.scores)
        return [Verdict(score, "", error) for score, error in zip(result.scores, errors,
                                                                   strict=True)]
