"""A generator's work loop: lease prompts, sample, score, send groups, keep weights fresh.

Threads: the compute loop here (engine and rewards) talks to the buffer with its own
request-reply socket; a ``Heartbeater`` thread keeps the generator's membership alive and
hears the learner's version; a ``WeightReceiver`` thread stages new weights. Staged
weights are applied only at safe points: before a lease that needs them, and between
decode steps (the engine's hook), so in-flight prompts are never dropped.

A lease whose weights never arrive, or whose generation fails, is returned to the buffer
so its prompts go to another generator.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import msgspec
import torch

from algorithms.reward_shaping import overlong_penalty
from algorithms.rewards.result import RewardItem
from algorithms.rewards.scorer import RewardScorer
from configs.run_schema import OverlongBufferConfig, RolloutConfig
from generators.engine import Completion, Engine
from generators.sampling import SamplingParams
from generators.weight_receiver import WeightReceiver
from transport.messages import (
    Attach,
    AttachAck,
    Detach,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseReturn,
    Prompt,
    PromptLease,
    RolloutAck,
    RolloutGroup,
    Sample,
    Shutdown,
)
from transport.security import ClientKeys
from transport.sockets import Client, PeerTimeout

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
HEARTBEAT_EVERY_S = 1.0


WEIGHTS_TIMEOUT_S = 300.0  # how long a lease may wait for the weights it needs


def sampling_params(rollout: RolloutConfig) -> SamplingParams:
    """The engine's sampling parameters for training rollouts."""
    return SamplingParams(max_new_tokens=rollout.response_length,
                          temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k)


class Counters:
    """Throughput counters shared with the heartbeat thread (plain ints: GIL-safe)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.groups_sent = 0
        self.groups_rejected = 0


class Heartbeater:
    """Sends heartbeats; notices a forgotten membership and the end of the run."""

    def __init__(self, generator_id: str, buffer_endpoint: str, engine: Engine,
                 counters: Counters, keys: ClientKeys | None) -> None:
        self._generator_id, self._buffer_endpoint = generator_id, buffer_endpoint
        self._engine, self._counters, self._keys = engine, counters, keys
        self.stop_requested = threading.Event()
        self.reattach = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeater:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(REQUEST_TIMEOUT_S)

    def _run(self) -> None:
        client = Client(self._buffer_endpoint, keys=self._keys)
        try:
            while not self._done.wait(HEARTBEAT_EVERY_S):
                beat = Heartbeat(generator_id=self._generator_id,
                                 version=self._engine.version,
                                 generated_tokens=self._counters.tokens,
                                 generation_seconds=self._counters.seconds)
                try:
                    reply = client.request(beat, REQUEST_TIMEOUT_S)
                except PeerTimeout:
                    logger.warning("the buffer did not answer a heartbeat")
                    continue
                if isinstance(reply, Shutdown):
                    logger.info("buffer says: %s", reply.reason)
                    self.stop_requested.set()
                    return  # the buffer is about to go: a later heartbeat would hang
                if isinstance(reply, HeartbeatAck) and not reply.known:
                    self.reattach.set()
        finally:
            client.close()


class GeneratorLoop:
    """The compute loop of one generator process.

    ``rollout`` is the run's rollout section; from the others it needs the prompt length
    limit (``data.max_prompt_length``) and DAPO's overlong penalty
    (``reward_model.overlong_buffer``).
    """

    def __init__(self, *, generator_id: str, buffer_endpoint: str, weights_endpoint: str,
                 engine: Engine, tokenizer, scorer: RewardScorer, rollout: RolloutConfig,
                 max_prompt_length: int, overlong: OverlongBufferConfig,
                 keys: ClientKeys | None = None,
                 weights_timeout_s: float = WEIGHTS_TIMEOUT_S) -> None:
        self.generator_id, self.buffer_endpoint = generator_id, buffer_endpoint
        self.engine, self.tokenizer, self.scorer = engine, tokenizer, scorer
        self.params = sampling_params(rollout)
        self.max_prompt_length, self.overlong = max_prompt_length, overlong
        self.weights_timeout_s = weights_timeout_s
        self.counters = Counters()
        self._buffer = Client(buffer_endpoint, keys=keys)
        self._weights = WeightReceiver(weights_endpoint, generator_id, keys=keys)
        self._heart = Heartbeater(generator_id, buffer_endpoint, engine, self.counters, keys)

    # -- lifecycle ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Work until ``stop`` is set or the buffer says the run is over."""
        if not self._attach():
            return
        self._weights.start(self.engine.version)
        self._heart.start()
        try:
            while not (stop.is_set() or self._heart.stop_requested.is_set()):
                if self._heart.reattach.is_set():
                    self._heart.reattach.clear()
                    if not self._attach():
                        return
                self._work_once(stop)
        finally:
            self._heart.stop()
            self._weights.stop()
            self._detach()
            self._buffer.close()

    def _attach(self) -> bool:
        reply = self._buffer.request(
            Attach(generator_id=self.generator_id, engine=self.engine.name,
                   device=str(getattr(self.engine, "device", "")), host=socket.gethostname(),
                   pid=os.getpid(), version=self.engine.version), REQUEST_TIMEOUT_S)
        if not isinstance(reply, AttachAck) or not reply.accepted:
            logger.info("not attached: %s", getattr(reply, "reason", reply))
            return False
        logger.info("attached to %s; learner at version %d", self.buffer_endpoint,
                    reply.learner_version)
        self.counters.tokens, self.counters.seconds = 0, 0.0  # heartbeats count from attach
        return True

    def _detach(self) -> None:
        try:
            self._buffer.request(Detach(generator_id=self.generator_id,
                                        reason="stopping"), 5.0)
        except PeerTimeout:
            logger.info("the buffer is gone; left without detaching")

    # -- one lease ----------------------------------------------------------------------

    def _work_once(self, stop: threading.Event) -> None:
        reply = self._buffer.request(LeaseRequest(generator_id=self.generator_id,
                                                  max_prompts=1 << 16), REQUEST_TIMEOUT_S)
        if isinstance(reply, Shutdown):
            logger.info("buffer says: %s", reply.reason)
            self._heart.stop_requested.set()
        elif isinstance(reply, ErrorReply) and reply.code == "not_attached":
            self._heart.reattach.set()
        elif isinstance(reply, PromptLease) and reply.prompts:
            self._serve(reply, stop)
        elif isinstance(reply, PromptLease):
            self.apply_staged_weights()
            stop.wait(reply.retry_after_s)
        else:
            raise RuntimeError(f"unexpected reply to a lease request: {reply!r}")

    def _serve(self, lease: PromptLease, stop: threading.Event) -> None:
        logger.info("lease %s: %d prompts x %d samples", lease.lease_id, len(lease.prompts),
                    lease.n)
        self.apply_staged_weights()
        if self.engine.version < lease.min_version and not self._wait_for(lease.min_version, stop):
            if self._heart.stop_requested.is_set():
                logger.info("lease %s dropped: the run has ended", lease.lease_id)
            else:
                self._give_back(lease, f"weights version {lease.min_version} never arrived")
            return
        began = time.monotonic()
        prompt_ids = [self._tokenize(p) for p in lease.prompts]
        try:
            completions = self._generate(prompt_ids, lease.n, self.params)
            greedy = self._generate(prompt_ids, 1, self.greedy_params) \
                if lease.greedy_baseline else None
        except Exception:
            self._give_back(lease, "generation failed")
            raise
        took = time.monotonic() - began
        if took > lease.expires_in_s:
            logger.warning("lease %s took %.0f s, past its %.0f s expiry: the buffer has "
                           "leased its prompts again and will refuse these groups (raise "
                           "buffer.lease_timeout_s)", lease.lease_id, took, lease.expires_in_s)
        for index, prompt in enumerate(lease.prompts):
            group = self._group(lease, prompt, prompt_ids[index],
                                completions[index * lease.n:(index + 1) * lease.n])
            if greedy is not None:
                group = self._with_baseline(group, prompt, greedy[index])
            self._send(group)

    @property
    def greedy_params(self) -> SamplingParams:
        """Greedy decoding with the rollout's length limit (ReMax's baseline response)."""
        return msgspec.structs.replace(self.params, temperature=0.0)

    def _generate(self, prompt_ids: list[list[int]], n: int,
                  params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, prompt after prompt."""
        batch = [ids for ids in prompt_ids for _ in range(n)]
        started = time.perf_counter()
        completions = self.engine.generate(batch, params,
                                           between_steps=self.apply_staged_weights)
        self.counters.seconds += time.perf_counter() - started
        self.counters.tokens += sum(c.token_ids.numel() for c in completions)
        return completions

    def _tokenize(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        limit = self.max_prompt_length
        if len(ids) > limit:
            logger.warning("prompt %s has %d tokens; keeping the last %d (data.max_prompt_length)",
                           prompt.prompt_id, len(ids), limit)
            ids = ids[-limit:]
        return list(ids)

    def _group(self, lease: PromptLease, prompt: Prompt, prompt_ids: list[int],
               completions: Sequence[Completion]) -> RolloutGroup:
        texts = [self.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
                 for c in completions]
        rewards = self.scorer.score([RewardItem(prompt.data_source, text, prompt.ground_truth,
                                                prompt.extra_info) for text in texts])
        prompt_tensor = torch.tensor(prompt_ids, dtype=torch.int32)
        samples = []
        for c, r, text in zip(completions, rewards, texts, strict=True):
            reward, info = self._shaped(r.score, r.info, c)
            samples.append(Sample(prompt_ids=prompt_tensor, response_ids=c.token_ids,
                                  logprobs=c.logprobs, versions=c.versions, reward=reward,
                                  finish_reason=c.finish_reason, reward_info=info,
                                  reward_error=r.error, text=text))
        return RolloutGroup(rollout_id=f"{lease.lease_id}/{prompt.prompt_id}",
                            lease_id=lease.lease_id, prompt_id=prompt.prompt_id,
                            generator_id=self.generator_id, samples=samples,
                            data_source=prompt.data_source, ground_truth=prompt.ground_truth)

    def _shaped(self, score: float, info: dict[str, float],
                completion: Completion) -> tuple[float, dict[str, float]]:
        """The reward with DAPO's overlong penalty added when it is on, and the penalty
        recorded as ``info["overlong_reward"]``."""
        overlong = self.overlong
        if not overlong.enable:
            return score, info
        penalty = float(overlong_penalty(torch.tensor([len(completion.token_ids)]),
                                         self.params.max_new_tokens, overlong.len,
                                         overlong.penalty_factor)[0])
        return score + penalty, {**info, "overlong_reward": penalty}

    def _with_baseline(self, group: RolloutGroup, prompt: Prompt,
                       greedy: Completion) -> RolloutGroup:
        """The group with the greedy response's reward as ``baseline_reward`` (ReMax)."""
        text = self.tokenizer.decode(greedy.token_ids.tolist(), skip_special_tokens=True)
        (result,) = self.scorer.score([RewardItem(prompt.data_source, text,
                                                  prompt.ground_truth, prompt.extra_info)])
        metadata = {**group.metadata, "greedy_text": text}
        if result.error:
            logger.warning("greedy baseline of %s scored 0: %s", group.rollout_id, result.error)
            metadata["greedy_reward_error"] = result.error
        baseline, _ = self._shaped(result.score, result.info, greedy)
        return msgspec.structs.replace(group, baseline_reward=baseline, metadata=metadata)

    def _send(self, group: RolloutGroup) -> None:
        reply = self._buffer.request(group, REQUEST_TIMEOUT_S)
        if isinstance(reply, RolloutAck) and reply.accepted:
            self.counters.groups_sent += 1
            return
        self.counters.groups_rejected += 1
        if isinstance(reply, RolloutAck):
            logger.warning("buffer refused %s: %s %s", group.rollout_id, reply.verdict,
                           reply.detail)
        else:
            logger.warning("buffer refused %s: %r", group.rollout_id, reply)

    def _give_back(self, lease: PromptLease, reason: str) -> None:
        logger.warning("returning lease %s: %s", lease.lease_id, reason)
        self._buffer.request(LeaseReturn(generator_id=self.generator_id,
                                         lease_id=lease.lease_id,
                                         prompt_ids=[p.prompt_id for p in lease.prompts],
                                         reason=reason), REQUEST_TIMEOUT_S)

    # -- weights ------------------------------------------------------------------------

    def apply_staged_weights(self) -> None:
        """Load a staged version if one is waiting (the safe-point hook)."""
        staged = self._weights.take()
        if staged is not None and staged.version > self.engine.version:
            self.engine.load_weights(staged.version, staged.tensors)
            logger.info("now generating with weights version %d", staged.version)

    def _wait_for(self, version: int, stop: threading.Event) -> bool:
        """Load weights ``version`` (or newer) once they arrive; False on a timeout or
        when the run is stopping (the learner may be gone and never publish them)."""
        deadline = time.monotonic() + self.weights_timeout_s
        while not (stop.is_set() or self._heart.stop_requested.is_set()) \
                and time.monotonic() < deadline:
            staged = self._weights.wait_for(version, timeout_s=0.5)
            if staged is not None:
                self.engine.load_weights(staged.version, staged.tensors)
                logger.info("now generating with weights version %d", staged.version)
                return True
        return False
