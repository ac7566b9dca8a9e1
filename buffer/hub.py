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
from buffer.staleness import lease_capacity, lease_min_version, oldest_version, staleness
from buffer.store import Admission, ReplayStore
from configs.run_schema import BufferConfig
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
    RolloutVerdict,
    SampleBatch,
    SampleRequest,
    Shutdown,
    VersionUpdate,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 0.1
# Where each refused group is counted: rejected (unsound or unknown), or dropped (sound but
# not trained on). "accepted" is counted as groups/accepted, "run_failed" as the failure.
REFUSALS: dict[RolloutVerdict, str] = {
    "duplicate": "rejected/duplicate", "unknown_lease": "rejected/unknown_lease",
    "malformed": "rejected/malformed", "stale": "dropped/stale_on_arrival",
    "zero_variance": "dropped/zero_variance"}
# Counters reported from the start (as 0) so that dashboards always have the series.
COUNTERS = ("groups/accepted", "groups/served", "dropped/stale", *REFUSALS.values(),
            "prompts/expired", "prompts/returned", "samples/reward_errors", "samples/filtered",
            "rejected/unexpected_message", "requests/bad_priorities")
RECENT_ROLLOUT_IDS = 100_000  # remembered to name duplicates precisely
RATE_WINDOW_S = 30.0  # generator throughput is averaged over this much wall time


class Hub:
    """Prompt leasing, rollout admission, batches for the learner, generator registry.

    ``config`` is the run's ``buffer`` section; from the other sections the hub needs the
    groups per learner step (``data.train_batch_size``), the samples per group
    (``rollout.n``), the prompts per lease (``rollout.prompts_per_lease``) and whether every
    group must carry a greedy baseline reward (ReMax).
    """

    def __init__(self, config: BufferConfig, source: PromptSource, store: ReplayStore,
                 log: RolloutLogWriter | None = None, *, batch_size: int, n: int,
                 prompts_per_lease: int, greedy_baseline: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.batch_size, self.n = batch_size, n
        self.prompts_per_lease, self.greedy_baseline = prompts_per_lease, greedy_baseline
        self.source = source
        self.store = store
        self.log = log
        self.clock = clock
        self.leases = LeaseBook(config.lease_timeout_s)
        self.registry = Registry(config.heartbeat_timeout_s)
        self.learner_version = 0
        self.learner_step = 0  # the step after which learner_version was published
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
        logger.info("generator %s attached (%s on %s of %s, pid %d, weights version %d)",
                    msg.generator_id, msg.engine, msg.device, msg.host, msg.pid, msg.version)
        return AttachAck(accepted=True, learner_version=self.learner_version)

    def _heartbeat(self, msg: Heartbeat) -> Message:
        if self.finished:
            return Shutdown(reason=self.end_reason)
        known = self.registry.heartbeat(msg, self.clock())
        return HeartbeatAck(known=known)

    def _detach(self, msg: Detach) -> Message:
        self._drop_generator(msg.generator_id, f"detached ({msg.reason or 'no reason given'})")
        return Ack()

    def _lease(self, msg: LeaseRequest) -> Message:
        if self.finished:
            return Shutdown(reason=self.end_reason)
        if not self.registry.touch(msg.generator_id, self.clock()):
            return ErrorReply(code="not_attached", detail=f"{msg.generator_id} must attach first")
        max_staleness = self.config.max_staleness
        capacity = lease_capacity(version=self.learner_version, max_staleness=max_staleness,
                                  batch_size=self.batch_size, accepted=self.accepted,
                                  running=self.leases.running)
        count = min(msg.max_prompts, self.prompts_per_lease, capacity)
        if count <= 0:
            self.counts["leases/gated"] += 1
            return PromptLease(lease_id="", retry_after_s=RETRY_AFTER_S)
        prompts = self.source.take(count)
        min_version = lease_min_version(version=self.learner_version,
                                        max_staleness=max_staleness, batch_size=self.batch_size,
                                        accepted=self.accepted, running=self.leases.running,
                                        count=len(prompts))
        lease = self.leases.grant(msg.generator_id, prompts, self.clock())
        self.counts["leases/granted"] += 1
        return PromptLease(lease_id=lease.lease_id, prompts=list(lease.outstanding.values()),
                           n=self.n, min_version=min_version,
                           expires_in_s=self.config.lease_timeout_s,
                           greedy_baseline=self.greedy_baseline)

    def _lease_return(self, msg: LeaseReturn) -> Message:
        prompts = self.leases.give_back(msg.lease_id, msg.prompt_ids, msg.generator_id)
        logger.info("generator %s returned %d prompts of lease %s: %s", msg.generator_id,
                    len(prompts), msg.lease_id, msg.reason or "no reason given")
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
        problem = group_problem(group, self.n, self.learner_version, self.greedy_baseline)
        if problem:
            self.source.give_back([prompt])
            return self._reject(group, "malformed", problem)
        if staleness(group, self.learner_version) > self.config.max_staleness:
            self.source.give_back([prompt])  # regenerate it with fresher weights
            return self._refuse(group, "stale")
        self._remember(group.rollout_id)
        try:
            admission = self.store.add(group)
        except ReplayFilterError as exc:
            return self._fail(group, str(exc))
        self.counts["samples/reward_errors"] += sum(1 for s in group.samples if s.reward_error)
        if self.log is not None:
            self.log.append(with_admission(group, admission))
        if not admission.kept:
            return self._refuse(group, admission.reason)
        self.accepted += 1
        self.counts["groups/accepted"] += 1
        self.counts["samples/filtered"] += len(group.samples) - len(admission.kept_samples)
        return RolloutAck(rollout_id=group.rollout_id, verdict="accepted")

    def _sample(self, msg: SampleRequest) -> Message:
        if msg.priorities:
            try:
                self.store.update_priorities(msg.priorities)
            except ValueError as exc:
                self.counts["requests/bad_priorities"] += 1
                return ErrorReply(code="bad_priorities", detail=str(exc))
        taken = self.store.take(msg.num_groups, self.learner_version, self.config.max_staleness)
        if taken.dropped_stale:
            self.accepted -= len(taken.dropped_stale)  # they never train: free their slots
            self.counts["dropped/stale"] += len(taken.dropped_stale)
        if taken.groups:
            self.counts["groups/served"] += len(taken.groups)
        return SampleBatch(groups=taken.groups, weights=taken.weights, buffer_stats=self.stats(),
                           retry_after_s=0.0 if taken.groups else RETRY_AFTER_S)

    def _version(self, msg: VersionUpdate) -> Message:
        if msg.version > self.learner_version:
            self.learner_version, self.learner_step = msg.version, msg.step
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
        return RolloutAck(rollout_id=group.rollout_id, verdict="run_failed", detail=why)

    def _reject(self, group: RolloutGroup, verdict: RolloutVerdict, detail: str = "") -> RolloutAck:
        """Refuse an unsound or unknown group, with a warning."""
        logger.warning("rejected rollout %s from %s: %s %s", group.rollout_id, group.generator_id,
                       verdict, detail)
        return self._refuse(group, verdict, detail)

    def _refuse(self, group: RolloutGroup, verdict: RolloutVerdict, detail: str = "") -> RolloutAck:
        self.counts[REFUSALS[verdict]] += 1
        return RolloutAck(rollout_id=group.rollout_id, verdict=verdict, detail=detail)

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
            "buffer/learner_step": float(self.learner_step),
            "buffer/generator_busy_frac": self.registry.busy_fraction(self.clock()),
            "buffer/generator_oldest_version": float(self.registry.oldest_version()),
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
