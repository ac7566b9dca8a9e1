"""The hub's logic: one reply per request, plus timers; no sockets.

``Hub.handle`` answers every request of the buffer's conversation (see
``transport.messages``): generators attach, heartbeat, lease prompts, return rollout groups
and detach; the learner reports versions, asks for batches and ends the run. ``Hub.tick``
expires leases and silent generators. ``buffer.main`` puts a socket around it.

Counters in ``Hub.stats()`` (``buffer/...``) say where every prompt and group went:
accepted, rejected by reason (duplicate, unknown lease, malformed), dropped as stale or by a
replay filter (``dropped/zero_variance``), samples a filter took out of kept groups.

Every sound, fresh group goes to the rollout log whole, before the store's filters, with
what they did in ``metadata["buffer_admission"]``: an offline replay sees everything the
generators produced and can tell what was trained on. A dropped group is not accepted: it
frees its admission slot, so a replacement is leased. A filter that cannot go on
(``ReplayFilterError``) ends the run: ``Hub.failure`` says why and ``buffer.main`` exits 1.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

import msgspec

from buffer.dynamic_sampling import ReplayFilterError
from buffer.leases import LeaseBook
from buffer.prompt_source import PromptSource
from buffer.registry import Registry
from buffer.rollout_log import RolloutLogWriter
from buffer.staleness import lease_capacity, oldest_version, staleness
from buffer.store import Admission, ReplayStore
from transport.messages import (
    Ack,
    Attach,
    AttachAck,
    Detach,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseReturn,
    Message,
    PromptLease,
    RolloutAck,
    RolloutGroup,
    SampleBatch,
    SampleRequest,
    Shutdown,
    VersionUpdate,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 0.1
# Counters reported from the start (as 0) so that dashboards always have the series.
COUNTERS = ("groups/accepted", "groups/served", "dropped/stale", "dropped/stale_on_arrival",
            "rejected/duplicate", "rejected/unknown_lease", "rejected/malformed",
            "prompts/expired", "prompts/returned", "samples/reward_errors",
            "dropped/zero_variance", "samples/filtered")
RECENT_ROLLOUT_IDS = 100_000  # remembered to name duplicates precisely
RATE_WINDOW_S = 30.0  # generator throughput is averaged over this much wall time


class HubSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The run-config values the hub acts on."""

    batch_size: int  # groups per learner step
    n: int  # samples per group
    max_staleness: int
    prompts_per_lease: int
    lease_timeout_s: float
    heartbeat_timeout_s: float
    weights_address: str
    greedy_baseline: bool = False  # ReMax: every group carries its greedy response's reward


class Hub:
    """Prompt leasing, rollout admission, batches for the learner, generator registry."""

    def __init__(self, settings: HubSettings, source: PromptSource, store: ReplayStore,
                 log: RolloutLogWriter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.source = source
        self.store = store
        self.log = log
        self.clock = clock
        self.leases = LeaseBook(settings.lease_timeout_s)
        self.registry = Registry(settings.heartbeat_timeout_s)
        self.learner_version = 0
        self.accepted = 0  # groups admitted to the store and not dropped
        self.finished = False
        self.failure = ""  # why the run must end with an error ("" while all is well)
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._recent_ids: OrderedDict[str, None] = OrderedDict()
        self._token_history: deque[tuple[float, int]] = deque()
        self._handlers: dict[type[Message], Callable[[Message], Message]] = {
            Attach: self._attach, Heartbeat: self._heartbeat, Detach: self._detach,
            LeaseRequest: self._lease, LeaseReturn: self._lease_return,
            RolloutGroup: self._rollout, SampleRequest: self._sample,
            VersionUpdate: self._version, Shutdown: self._shutdown,
        }

    # -- the conversation ---------------------------------------------------------------

    def handle(self, msg: Message, identity: bytes = b"") -> Message:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counts["rejected/unexpected_message"] += 1
            return ErrorReply(code="unexpected", detail=f"the buffer does not take "
                                                        f"{type(msg).__name__}")
        return handler(msg)

    def _attach(self, msg: Attach) -> Message:
        if self.finished:
            return AttachAck(accepted=False, reason=self.end_reason)
        returned = self.leases.release(msg.generator_id)  # a restarted generator
        self.source.give_back(returned)
        self.registry.attach(msg, self.clock())
        logger.info("generator %s attached (%s on %s, pid %d)", msg.generator_id, msg.engine,
                    msg.device, msg.pid)
        return AttachAck(accepted=True, learner_version=self.learner_version,
                         weights_address=self.settings.weights_address)

    def _heartbeat(self, msg: Heartbeat) -> Message:
        if self.finished:
            return Shutdown(reason=self.end_reason)
        known = self.registry.heartbeat(msg, self.clock())
        return HeartbeatAck(known=known, learner_version=self.learner_version)

    def _detach(self, msg: Detach) -> Message:
        self._drop_generator(msg.generator_id, f"detached ({msg.reason or 'no reason given'})")
        return Ack()

    def _lease(self, msg: LeaseRequest) -> Message:
        if self.finished:
            return Shutdown(reason=self.end_reason)
        if not self.registry.touch(msg.generator_id, self.clock()):
            return ErrorReply(code="not_attached", detail=f"{msg.generator_id} must attach first")
        s = self.settings
        capacity = lease_capacity(version=self.learner_version, max_staleness=s.max_staleness,
                                  batch_size=s.batch_size, accepted=self.accepted,
                                  running=self.leases.running)
        count = min(msg.max_prompts, s.prompts_per_lease, capacity)
        if count <= 0:
            self.counts["leases/gated"] += 1
            return PromptLease(lease_id="", retry_after_s=RETRY_AFTER_S)
        lease = self.leases.grant(msg.generator_id, self.source.take(count), self.clock())
        self.counts["leases/granted"] += 1
        return PromptLease(lease_id=lease.lease_id, prompts=list(lease.outstanding.values()),
                           n=s.n, min_version=max(0, self.learner_version - s.max_staleness),
                           expires_in_s=s.lease_timeout_s, greedy_baseline=s.greedy_baseline)

    def _lease_return(self, msg: LeaseReturn) -> Message:
        prompts = self.leases.give_back(msg.lease_id, msg.prompt_ids, msg.generator_id)
        self.source.give_back(prompts)
        self.counts["prompts/returned"] += len(prompts)
        return Ack(detail=f"{len(prompts)} prompts back in the pool")

    def _rollout(self, group: RolloutGroup) -> Message:
        self.registry.touch(group.generator_id, self.clock())
        if group.rollout_id in self._recent_ids:
            return self._reject(group, "duplicate")
        prompt = self.leases.complete(group.lease_id, group.prompt_id, group.generator_id)
        if prompt is None:
            return self._reject(group, "unknown_lease")
        problem = group_problem(group, self.settings.n, self.learner_version,
                                self.settings.greedy_baseline)
        if problem:
            self.source.give_back([prompt])
            return self._reject(group, "malformed", problem)
        if staleness(group, self.learner_version) > self.settings.max_staleness:
            self.source.give_back([prompt])  # regenerate it with fresher weights
            self.counts["dropped/stale_on_arrival"] += 1
            return RolloutAck(rollout_id=group.rollout_id, accepted=False, reason="stale")
        self._remember(group.rollout_id)
        try:
            admission = self.store.add(group)
        except ReplayFilterError as exc:
            return self._fail(group, str(exc))
        self.counts["samples/reward_errors"] += sum(1 for s in group.samples if s.reward_error)
        if self.log is not None:
            self.log.append(with_admission(group, admission))
        if not admission.kept:
            self.counts[f"dropped/{admission.reason}"] += 1
            return RolloutAck(rollout_id=group.rollout_id, accepted=False,
                              reason=admission.reason)
        self.accepted += 1
        self.counts["groups/accepted"] += 1
        self.counts["samples/filtered"] += len(group.samples) - len(admission.kept_samples)
        return RolloutAck(rollout_id=group.rollout_id, accepted=True)

    def _sample(self, msg: SampleRequest) -> Message:
        self.learner_version = max(self.learner_version, msg.version)
        if msg.priorities:
            try:
                self.store.update_priorities(msg.priorities)
            except ValueError as exc:
                self.counts["rejected/malformed"] += 1
                return ErrorReply(code="malformed", detail=f"priorities: {exc}")
        taken = self.store.take(msg.num_groups, self.learner_version, self.settings.max_staleness)
        if taken.dropped_stale:
            self.accepted -= len(taken.dropped_stale)  # they never train: free their slots
            self.counts["dropped/stale"] += len(taken.dropped_stale)
        if taken.groups:
            self.counts["groups/served"] += len(taken.groups)
        return SampleBatch(groups=taken.groups, weights=taken.weights, buffer_stats=self.stats(),
                           retry_after_s=0.0 if taken.groups else RETRY_AFTER_S)

    def _version(self, msg: VersionUpdate) -> Message:
        if msg.version > self.learner_version:
            self.learner_version = msg.version
        return Ack()

    def _shutdown(self, msg: Shutdown) -> Message:
        logger.info("the learner ended the run: %s", msg.reason)
        self.finished = True
        return Ack()

    # -- timers, bookkeeping ------------------------------------------------------------

    def tick(self) -> None:
        """Return expired leases' prompts to the pool; forget silent generators."""
        now = self.clock()
        expired = self.leases.expire(now)
        if expired:
            logger.warning("%d leased prompts expired; back in the pool", len(expired))
            self.counts["prompts/expired"] += len(expired)
            self.source.give_back(expired)
        for generator_id in self.registry.silent(now):
            self._drop_generator(generator_id, "silent past the heartbeat timeout")
        self._token_history.append((now, self.registry.generated_tokens))
        while now - self._token_history[0][0] > RATE_WINDOW_S:
            self._token_history.popleft()

    def generator_tokens_per_s(self) -> float:
        """Tokens generated per wall-clock second by all generators, over the last window."""
        if len(self._token_history) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._token_history[0], self._token_history[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _drop_generator(self, generator_id: str, why: str) -> None:
        if self.registry.forget(generator_id):
            logger.warning("generator %s %s", generator_id, why)
        self.source.give_back(self.leases.release(generator_id))

    def _fail(self, group: RolloutGroup, why: str) -> RolloutAck:
        logger.error("the run cannot go on: %s", why)
        self.failure = why
        self.finished = True  # generators are told to stop
        return RolloutAck(rollout_id=group.rollout_id, accepted=False, reason=f"run failed: {why}")

    def _reject(self, group: RolloutGroup, reason: str, detail: str = "") -> RolloutAck:
        self.counts[f"rejected/{reason}"] += 1
        logger.warning("rejected rollout %s from %s: %s %s", group.rollout_id, group.generator_id,
                       reason, detail)
        return RolloutAck(rollout_id=group.rollout_id, accepted=False,
                          reason=f"{reason}: {detail}" if detail else reason)

    def _remember(self, rollout_id: str) -> None:
        self._recent_ids[rollout_id] = None
        if len(self._recent_ids) > RECENT_ROLLOUT_IDS:
            self._recent_ids.popitem(last=False)

    @property
    def end_reason(self) -> str:
        return f"the run failed: {self.failure}" if self.failure else "the run has finished"

    @property
    def generators(self) -> int:
        return len(self.registry.generators)

    def stats(self) -> dict[str, float]:
        """Gauges and counters for the learner's tracker and the status line."""
        stats = {f"buffer/{k}": float(v) for k, v in self.counts.items()}
        stats.update({f"buffer/{k}": v for k, v in self.store.stats().items()})
        stats.update({
            "buffer/occupancy": float(len(self.store)),
            "buffer/running_prompts": float(self.leases.running),
            "buffer/pool_prompts": float(self.source.returned),
            "buffer/accepted_live": float(self.accepted),
            "buffer/generators": float(self.generators),
            "buffer/generator_tokens_total": float(self.registry.generated_tokens),
            "buffer/generator_tokens_per_s": self.generator_tokens_per_s(),
            "buffer/learner_version": float(self.learner_version),
            "buffer/epoch": float(self.source.epoch),
        })
        return stats


def with_admission(group: RolloutGroup, admission: Admission) -> RolloutGroup:
    """The whole group, for the rollout log, noting which samples were kept (none when the
    group was dropped) and why it was dropped."""
    note = {"kept_samples": list(admission.kept_samples), "dropped": admission.reason}
    return msgspec.structs.replace(group, metadata={**group.metadata, "buffer_admission": note})


def group_problem(group: RolloutGroup, n: int, learner_version: int,
                  greedy_baseline: bool = False) -> str:
    """Why a group cannot be trained on, or "" when it is sound."""
    if len(group.samples) != n:
        return f"{len(group.samples)} samples, the lease asked for {n}"
    if greedy_baseline and (group.baseline_reward is None
                            or not math.isfinite(group.baseline_reward)):
        return (f"baseline_reward is {group.baseline_reward}; the lease asked for the greedy "
                "response's reward (ReMax's baseline)")
    for i, s in enumerate(group.samples):
        length = s.response_ids.numel()
        if s.prompt_ids.dim() != 1 or s.response_ids.dim() != 1 or s.prompt_ids.numel() == 0:
            return f"sample {i}: prompt and response ids must be non-empty 1-D tensors"
        if length == 0:
            return f"sample {i}: empty response"
        if s.logprobs.shape != (length,) or s.versions.shape != (length,):
            return (f"sample {i}: {length} response tokens but logprobs {tuple(s.logprobs.shape)}"
                    f" and versions {tuple(s.versions.shape)}")
        if s.prompt_ids.is_floating_point() or s.response_ids.is_floating_point() \
                or s.versions.is_floating_point():
            return f"sample {i}: token ids and versions must be integers"
        if not bool(s.logprobs.isfinite().all()) or bool((s.logprobs > 1e-4).any()):
            return f"sample {i}: log-probs must be finite and <= 0"
        if not math.isfinite(s.reward):
            return f"sample {i}: reward {s.reward} is not finite"
    newest = max(int(s.versions.max()) for s in group.samples)
    if oldest_version(group) < 0 or newest > learner_version:
        return (f"token versions span [{oldest_version(group)}, {newest}] but the learner is "
                f"at version {learner_version}")
    return ""
