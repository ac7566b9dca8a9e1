"""Scoring finished groups and sending them to the buffer, beside the compute loop.

The compute loop hands each finished prompt (its completions, already decoded to text) to
``GroupSender`` and goes straight back to generating; the sender's thread scores the texts,
applies DAPO's overlong penalty, builds the ``RolloutGroup`` and waits for the buffer's ack
on its own socket. A failure in the thread (a reward scorer that cannot run, a reward server
or a buffer that stops answering) is kept and raised in the compute loop by
``raise_if_failed``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import msgspec
import torch

from relay.algorithms.reward_shaping import overlong_penalty
from relay.algorithms.rewards.result import RewardItem, RewardResult
from relay.algorithms.rewards.scorer import RewardScorer
from relay.configs.run_schema import OverlongBufferConfig
from relay.generators.engine import Completion
from relay.generators.judge import Judge
from relay.generators.reward_client import RemoteJudge, RemoteRewardModel
from relay.generators.reward_model import RewardModelScorer, combined
from relay.generators.workflow import EpisodeCompletion
from relay.transport.messages import Prompt, RolloutAck, RolloutGroup, Sample
from relay.transport.retry import patient_request
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0


class Counters:
    """Throughput counters shared with the heartbeat thread (plain ints: GIL-safe)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.groups_sent = 0
        self.groups_rejected = 0


class FinishedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt's samples (and its greedy response, for ReMax), ready to score."""

    rollout_id: str
    lease_id: str
    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Completion]
    texts: list[str]
    greedy: Completion | None = None
    greedy_text: str = ""


class GroupSender:
    """A thread that scores ``FinishedPrompt``s and sends them as ``RolloutGroup``s."""

    def __init__(self, *, generator_id: str, buffer_endpoint: str, scorer: RewardScorer,
                 counters: Counters, max_new_tokens: int, overlong: OverlongBufferConfig,
                 patience_s: float, keys: ClientKeys | None = None,
                 reward_model: RewardModelScorer | RemoteRewardModel | None = None,
                 judge: Judge | RemoteJudge | None = None) -> None:
        self.generator_id, self.scorer, self.counters = generator_id, scorer, counters
        # reward_model.enable: scores beside the rule's (here or by a reward server)
        self.reward_model = reward_model
        self.judge = judge  # reward_model.judge.enable: the same, by an LLM's answers
        self.patience_s = patience_s  # retrying a buffer that does not answer
        self.max_new_tokens, self.overlong = max_new_tokens, overlong
        self._endpoint, self._keys = buffer_endpoint, keys
        self._queue: queue.Queue[FinishedPrompt | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)

    def start(self) -> GroupSender:
        self._thread.start()
        return self

    def put(self, finished: FinishedPrompt) -> None:
        self._queue.put(finished)

    @property
    def waiting(self) -> int:
        """Groups handed over and not yet sent."""
        return self._queue.qsize()

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError("scoring or sending a group failed") from self._failure

    def stop(self, *, discard: bool = False, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Send what was handed over (or, with ``discard``, drop what is not yet being
        sent), then end the thread."""
        while discard and not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the sender did not finish within %.0f s", timeout_s)

    def _run(self) -> None:
        client = Client(self._endpoint, keys=self._keys)
        try:
            while (finished := self._queue.get()) is not None:
                self.send(client, self.build(finished))
        except BaseException as error:  # noqa: BLE001 - kept and raised in the compute loop
            self._failure = error
        finally:
            client.close()

    # -- one group ----------------------------------------------------------------------

    def build(self, finished: FinishedPrompt) -> RolloutGroup:
        """Score every sample (and the greedy response) and assemble the group. An episode
        whose workflow gave its own reward keeps it; the reward function scores the rest."""
        prompt = finished.prompt
        rewards = self._with_rm(prompt, finished.prompt_ids, finished.completions,
                                finished.texts,
                                self._scores(prompt, finished.completions, finished.texts))
        prompt_tensor = torch.tensor(finished.prompt_ids, dtype=torch.int32)
        samples = []
        for c, r, text in zip(finished.completions, rewards, finished.texts, strict=True):
            reward, info = self._shaped(r.score, r.info, c)
            episode = c if isinstance(c, EpisodeCompletion) else None
            if episode is not None:
                info = {**info, **episode.reward_info}
            samples.append(Sample(prompt_ids=prompt_tensor, response_ids=c.token_ids,
                                  logprobs=c.logprobs, versions=c.versions, reward=reward,
                                  finish_reason=c.finish_reason, reward_info=info,
                                  reward_error=r.error, text=text,
                                  loss_mask=None if episode is None else episode.loss_mask,
                                  episode=None if episode is None else episode.stats))
        group = RolloutGroup(rollout_id=finished.rollout_id, lease_id=finished.lease_id,
                             prompt_id=prompt.prompt_id, generator_id=self.generator_id,
                             samples=samples, data_source=prompt.data_source,
                             ground_truth=prompt.ground_truth)
        if finished.greedy is not None:
            group = self._with_baseline(group, prompt, finished.greedy, finished.greedy_text)
        return group

    def _scores(self, prompt: Prompt, completions: Sequence[Completion],
                texts: Sequence[str]) -> list[RewardResult]:
        """One result per completion: the workflow's reward, else the reward function's
        (one scorer call for all those that need it)."""
        own = [c.reward if isinstance(c, EpisodeCompletion) else None for c in completions]
        scored = iter(self.scorer.score([
            RewardItem(prompt.data_source, text, prompt.ground_truth, prompt.extra_info)
            for text, reward in zip(texts, own, strict=True) if reward is None]))
        return [next(scored) if reward is None else RewardResult(score=reward)
                for reward in own]

    def _with_rm(self, prompt: Prompt, prompt_ids: Sequence[int],
                 completions: Sequence[Completion], texts: Sequence[str],
                 rules: list[RewardResult]) -> list[RewardResult]:
        """The rule results combined with the reward model's scores or the judge's verdicts
        (one batched call for the prompt's completions), or as they are without either."""
        rm, judge = self.reward_model, self.judge
        if rm is not None:
            scores = rm.score(prompt.messages, prompt_ids,
                              [c.token_ids.tolist() for c in completions], texts)
            rules = [combined(rule, score, rm.config.combine)
                     for rule, score in zip(rules, scores, strict=True)]
        if judge is not None:
            verdicts = judge.judge(prompt.messages, texts, prompt.ground_truth)
            rules = [combined(rule, v.score, judge.combine, key="judge_score", error=v.error)
                     for rule, v in zip(rules, verdicts, strict=True)]
        return rules

    def _shaped(self, score: float, info: dict[str, float],
                completion: Completion) -> tuple[float, dict[str, float]]:
        """The reward with DAPO's overlong penalty added when it is on, and the penalty
        recorded as ``info["overlong_reward"]``."""
        overlong = self.overlong
        if not overlong.enable:
            return score, info
        penalty = float(overlong_penalty(torch.tensor([len(completion.token_ids)]),
                                         self.max_new_tokens, overlong.len,
                                         overlong.penalty_factor)[0])
        return score + penalty, {**info, "overlong_reward": penalty}

    def _with_baseline(self, group: RolloutGroup, prompt: Prompt, greedy: Completion,
                       text: str) -> RolloutGroup:
        """The group with the greedy response's reward as ``baseline_reward`` (ReMax)."""
        rule = self.scorer.score([RewardItem(prompt.data_source, text, prompt.ground_truth,
                                             prompt.extra_info)])
        (result,) = self._with_rm(prompt, group.samples[0].prompt_ids.tolist(), [greedy],
                                  [text], rule)
        metadata = {**group.metadata, "greedy_text": text}
        if result.error:
            logger.warning("greedy baseline of %s scored 0: %s", group.rollout_id, result.error)
            metadata["greedy_reward_error"] = result.error
        baseline, _ = self._shaped(result.score, result.info, greedy)
        return msgspec.structs.replace(group, baseline_reward=baseline, metadata=metadata)

    def send(self, client: Client, group: RolloutGroup) -> None:
        """Send one group (retried through a buffer stall) and count the buffer's verdict;
        refusals are logged by name (after a stall, ``duplicate`` may mean that an earlier
        try got through)."""
        reply = patient_request(client, group, REQUEST_TIMEOUT_S, self.patience_s)
        if isinstance(reply, RolloutAck) and reply.accepted:
            self.counters.groups_sent += 1
            return
        self.counters.groups_rejected += 1
        if isinstance(reply, RolloutAck):
            logger.warning("buffer refused %s: %s %s", group.rollout_id, reply.verdict,
                           reply.detail)
        else:
            logger.warning("buffer refused %s: %r", group.rollout_id, reply)


def decode_all(tokenizer, completions: Sequence[Completion]) -> list[str]:
    """Response texts, special tokens skipped."""
    return [tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
            for c in completions]
