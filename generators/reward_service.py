"""What a reward server answers: a ``ScoreRequest`` in, a ``ScoreReply`` (or why not) out.

The service holds the run's discriminative reward model and/or LLM judge
(``relay.generators.learned_rewards``) and knows nothing of sockets: the reward server
(``relay.generators.reward_server``) hands it each decoded request with its ``Peer``.

A request is answered in the order of its items, each item's scores in the order of its
responses, under the request's ``request_id`` and each item's ``item_id``. A request this
server cannot answer gets an ``ErrorReply`` naming the problem, and the server goes on:

- ``unexpected``: not a ``ScoreRequest``;
- ``forbidden``: the peer's CURVE key is not one a generator holds (``relay.transport.roles``);
- ``bad_request``: a scorer the server does not hold (``kind = "judge"`` when the run has no
  judge), no items, an item id given twice, an item without responses, ``responses`` and
  ``texts`` of different lengths, a token id outside the reward model's vocabulary.

A scorer that raises on a sound request is the socket server's ``handler`` error (logged
with its traceback, answered, and the server keeps serving).
"""

from __future__ import annotations

import logging
from collections import Counter

from relay.generators.judge import EndpointJudge, EngineJudge
from relay.generators.reward_model import RewardModelScorer
from relay.transport.messages import (
    ErrorReply,
    Message,
    ScoreItem,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
)
from relay.transport.roles import PeerRoles
from relay.transport.sockets import Peer

logger = logging.getLogger(__name__)


class ScoreService:
    """Answers score requests with ``reward_model`` and ``judge`` (either may be None, not
    both)."""

    def __init__(self, reward_model: RewardModelScorer | None,
                 judge: EngineJudge | EndpointJudge | None) -> None:
        if reward_model is None and judge is None:
            raise ValueError("a reward server needs reward_model.enable or "
                             "reward_model.judge.enable: it has nothing to score with")
        self.reward_model, self.judge = reward_model, judge
        self.roles = PeerRoles()
        self.refused: Counter[str] = Counter()  # bad requests, by code
        self.scored = 0  # responses scored
        self.vocab_size = reward_model.model.config.vocab_size if reward_model else 0

    def handle(self, message: Message, peer: Peer) -> Message:
        """The reply to one request (module docstring)."""
        if not isinstance(message, ScoreRequest):
            return self._refuse("unexpected", f"a reward server answers ScoreRequest, not "
                                              f"{type(message).__name__}")
        refusal = self.roles.admit(peer, "generator")
        if refusal:
            return self._refuse("forbidden", refusal)
        problem = self.problem(message)
        if problem:
            return self._refuse("bad_request", f"request {message.request_id!r}: {problem}")
        results = [self._score(message.kind, item) for item in message.items]
        self.scored += sum(len(r.scores) for r in results)
        return ScoreReply(request_id=message.request_id, results=results)

    def problem(self, request: ScoreRequest) -> str:
        """What makes ``request`` one this server cannot answer, or ""."""
        if request.kind == "reward_model" and self.reward_model is None:
            return ("this reward server holds no reward model (reward_model.enable is off or "
                    "is PRIME's PRM); ask kind 'judge'")
        if request.kind == "judge" and self.judge is None:
            return ("this reward server holds no judge (reward_model.judge.enable is off); "
                    "ask kind 'reward_model'")
        if not request.items:
            return "no items to score"
        ids = [item.item_id for item in request.items]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            return f"item id {twice[0]!r} given twice: each result is matched by its id"
        for item in request.items:
            problem = self._item_problem(request.kind, item)
            if problem:
                return f"item {item.item_id!r}: {problem}"
        return ""

    def _item_problem(self, kind: str, item: ScoreItem) -> str:
        if item.responses and item.texts and len(item.responses) != len(item.texts):
            return (f"{len(item.responses)} responses but {len(item.texts)} texts: one text "
                    "per response")
        if kind == "judge" or (self.reward_model is not None and self.reward_model.retemplate):
            return "" if item.texts else "no texts to score (one per response)"
        if not item.responses:
            return "no responses to score (the policy's token ids, one list per response)"
        ids = [*item.prompt_ids, *(t for r in item.responses for t in r)]
        if any(not item.prompt_ids and not r for r in item.responses):
            return "an empty sequence (no prompt ids and an empty response)"
        bad = next((t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)),
                   None)
        if bad is not None:
            return (f"token id {bad} is outside the reward model's vocabulary "
                    f"(0 to {self.vocab_size - 1})")
        return ""

    def _score(self, kind: str, item: ScoreItem) -> ScoreResult:
        """One item's scores (and a judge's errors), in its responses' order."""
        if kind == "reward_model":
            assert self.reward_model is not None, "problem() refuses it"
            scores = self.reward_model.score(item.messages, item.prompt_ids, item.responses,
                                             item.texts)
            return ScoreResult(item_id=item.item_id, scores=[float(s) for s in scores])
        assert self.judge is not None, "problem() refuses it"
        verdicts = self.judge.judge(item.messages, item.texts, item.ground_truth)
        errors = [v.error for v in verdicts]
        return ScoreResult(item_id=item.item_id, scores=[float(v.score) for v in verdicts],
                           errors=errors if any(errors) else [])

    def _refuse(self, code: str, detail: str) -> ErrorReply:
        self.refused[code] += 1
        logger.warning("refused a request (%s): %s", code, detail)
        return ErrorReply(code=code, detail=detail[:300])  # type: ignore[arg-type]
