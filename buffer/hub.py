"""The hub's logic: one reply per request, plus timers; no sockets.

``Hub.handle`` answers every request of the buffer's conversation (see
``relay.transport.messages``): generators attach, heartbeat, lease prompts, return rollout groups
and detach; the learner reports versions, asks for batches and for the buffer's state when
it writes a checkpoint (``relay.buffer.main``: resuming), and ends the run; ``Hub.stop`` ends it
from outside. Once the run is over, each generator's next request is answered with
``Shutdown`` and the reason, and the generator is forgotten. ``Hub.tick``
expires leases and silent generators. ``relay.buffer.main`` puts a socket around it.

Counters in ``Hub.stats()`` (``buffer/...``) say where every prompt and group went:
accepted, rejected by reason (duplicate, unknown lease, malformed), dropped as stale or by a
replay filter (``dropped/zero_variance``), samples a filter took out of kept groups.

Accounting: every prompt a lease hands out (``prompts/leased``) is answered by a group
(``prompts/completed``), given back unanswered by its generator or because the generator
left (``prompts/returned``), expired, or still in flight (``running_prompts``). Every
answering group is admitted to the store (``groups/accepted``), dropped by a replay filter,
refused as stale on arrival or as unsound (both return its prompt to the pool), fails the
run, or meets a store error (its prompt back in the pool). Every admitted group is trained
on (``groups/trained``: its first batch), dropped as stale inside the store
(``dropped/stale``: its prompt back in the pool, like a group stale on arrival, except
that a group a prioritized store evicted by age after its draws passed it over, counted
also as ``dropped/evicted``, sends its prompt to the back of the epoch: generated again at
once it would most likely be passed over again), or stored and never trained yet
(``groups/stored``). ``evicted_frac`` is ``dropped/evicted`` over ``groups/accepted``.
``Hub.accounting_problems`` checks these sums; ``stats`` reports how many fail
(``accounting_problems``, 0 while all is well).

Authorization: ``SENDERS`` names the role (``relay.transport.roles``) that may send each request;
a request from a connection in another role, or whose CURVE key may not take that role,
is refused (``ErrorReply(code="forbidden")``) and counted (``rejected/forbidden``). A
generator's name belongs to one live process: another process attaching under it is
refused, with the time after which the name may be free (``rejected/name_in_use``), unless
it is of the holder's lineage (``Attach.lineage``, not empty: the launcher's token for one
topology generator, the same across its restarts; it starts a process of a lineage only
after the last one died, on whichever host or pid). It takes the name at once, the dead
process's leased prompts go back to the pool, and it is counted (``generators/replaced``)
and logged; another lineage, or none, changes nothing. A generator may lie about its
lineage or pid as about anything else: a lineage is a claim among processes already
authorized as generators, not a credential. Values
no honest learner sends (``relay.buffer.validation``) are refused as ``bad_request``, and a
rollout group is judged whole before its prompt leaves the lease.

Every sound, fresh group goes to the rollout log whole, before the store's filters, with
what they did in ``metadata["buffer_admission"]``, and every batch served goes there as a
``StepRecord`` under the learner step it was asked for: an offline replay
(``relay.learner.replay``) sees everything the generators produced and knows what each step
trained on. The log is synced to disk whenever the learner writes a checkpoint. A batch
request repeated for the step last served (the learner's retry after a lost reply) gets
the same batch again, so a lost reply loses no groups; a lease request asked again (its
``request_id``) gets the lease granted for it, and a lease no heartbeat names is not renewed
(``relay.buffer.leases``), so no prompt stays parked with a generator that never heard of it. A
dropped group is not accepted: it frees its admission slot, so a replacement is leased. A
filter that cannot go on (``ReplayFilterError``) ends the run: ``Hub.failure`` says why and
``relay.buffer.main`` exits 1.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

import msgspec

from relay.buffer.dynamic_sampling import ReplayFilterError
from relay.buffer.fingerprint import Fingerprint
from relay.buffer.leases import Lease, LeaseBook
from relay.buffer.prompt_source import PromptSource
from relay.buffer.registry import Registry
from relay.buffer.rollout_dump import RolloutDump, write_dump
from relay.buffer.rollout_log import RolloutLogWriter, StepRecord
from relay.buffer.staleness import LearnerPosition, lease_capacity, lease_min_version, staleness
from relay.buffer.store import Admission, PriorityError, ReplayStore, Taken
from relay.buffer.validation import (
    GroupLimits,
    group_problem,
    sample_request_problem,
    version_problem,
)
from relay.configs.run_schema import BufferConfig
from relay.transport.messages import (
    Ack,
    Attach,
    AttachAck,
    BufferCheckpoint,
    BufferCheckpointRequest,
    Detach,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseReturn,
    Message,
    Prompt,
    PromptLease,
    RolloutAck,
    RolloutGroup,
    RolloutVerdict,
    SampleBatch,
    SampleRequest,
    Shutdown,
    VersionUpdate,
)
from relay.transport.roles import PeerRoles, Role
from relay.transport.sockets import Peer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 0.1
STILL_ASKING_S = 3 * RETRY_AFTER_S  # a generator refused this recently is still asking
# Where each refused group is counted: rejected (unsound or unknown), or dropped (sound but
# not trained on). "accepted" is counted as groups/accepted, "run_failed" as the failure.
REFUSALS: dict[RolloutVerdict, str] = {
    "duplicate": "rejected/duplicate", "unknown_lease": "rejected/unknown_lease",
    "malformed": "rejected/malformed", "stale": "dropped/stale_on_arrival",
    "zero_variance": "dropped/zero_variance"}
# Where a group that answered its prompt went, besides the store (accounting)
ANSWER_OUTCOMES = ("groups/failed", "groups/store_errors",
                   *(REFUSALS[v] for v in ("malformed", "stale", "zero_variance")))
# Counters reported from the start (as 0) so that dashboards always have the series.
COUNTERS = ("groups/accepted", "groups/served", "groups/trained", "groups/failed",
            "groups/store_errors", "dropped/stale", "dropped/evicted", *REFUSALS.values(),
            "prompts/leased", "prompts/completed", "prompts/expired", "prompts/returned",
            "samples/reward_errors", "samples/filtered", "rejected/unexpected_message",
            "rejected/forbidden", "rejected/bad_request", "rejected/name_in_use",
            "generators/replaced", "requests/bad_priorities", "rollout_log/write_errors",
            "rollout_dump/write_errors")
SENDERS: dict[type[Message], Role] = {
    Attach: "generator", Heartbeat: "generator", Detach: "generator",
    LeaseRequest: "generator", LeaseReturn: "generator", RolloutGroup: "generator",
    SampleRequest: "learner", VersionUpdate: "learner", Shutdown: "learner",
    BufferCheckpointRequest: "learner",
}
"""The role that may send each request the hub takes."""
RECENT_ROLLOUT_IDS = 100_000  # remembered to name duplicates precisely
RATE_WINDOW_S = 30.0  # generator throughput is averaged over this much wall time


class Hub:
    """Prompt leasing, rollout admission, batches for the learner, generator registry.

    ``config`` is the run's ``buffer`` section; from the other sections the hub needs the
    groups per learner step (``data.train_batch_size``), what a sound group fits
    (``limits``: ``rollout.n``, ``rollout.response_length``, the model's vocabulary, and
    whether every group must carry a greedy baseline reward, ReMax), the prompts per lease
    (``rollout.prompts_per_lease``) and the run's length (``trainer.total_training_steps``).
    """

    def __init__(self, config: BufferConfig, source: PromptSource, store: ReplayStore,
                 log: RolloutLogWriter | None = None, *, batch_size: int, limits: GroupLimits,
                 prompts_per_lease: int, total_steps: int, steps_per_version: int = 1,
                 dump: RolloutDump | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.batch_size, self.limits = batch_size, limits
        self.prompts_per_lease, self.total_steps = prompts_per_lease, total_steps
        self.source = source
        self.store = store
        self.log = log
        self.dump = dump  # trainer.rollout_data_dir: each step's samples as verl's JSONL
        self.clock = clock
        self.leases = LeaseBook(config.lease_timeout_s)
        self.registry = Registry(config.heartbeat_timeout_s)
        self._leasing = False  # set once buffer.min_generators attached (_enough_generators)
        self._idle_refused: dict[str, float] = {}  # holding nothing, refused a lease: when
        self.learner_version = 0
        self.learner_step = 0  # the step after which learner_version was published
        self.requested_step = 0  # the last step the learner asked a batch for
        self.steps_per_version = steps_per_version  # trainer.publish_every
        self.accepted = 0  # groups admitted to the store and not dropped
        self.finished = False
        self.failure = ""  # why the run must end with an error ("" while all is well)
        self.stopped = ""  # why the run was stopped from outside (``stop``; "": it was not)
        self.fingerprint: Fingerprint = {}  # what the checkpoints' state holds under
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self.roles = PeerRoles()
        self._untrained: dict[str, Prompt] = {}  # groups stored, never trained: prompts
        self._accounting_ok = True
        self._recent_ids: OrderedDict[str, None] = OrderedDict()
        self._served: tuple[int, SampleBatch] | None = None  # the last batch and its step
        self._token_history: deque[tuple[float, int]] = deque()
        self._handlers: dict[type[Message], Callable[[Message], Message]] = {
            Attach: self._attach, Heartbeat: self._heartbeat, Detach: self._detach,
            LeaseRequest: self._lease, LeaseReturn: self._lease_return,
            RolloutGroup: self._rollout, SampleRequest: self._sample,
            VersionUpdate: self._version, Shutdown: self._shutdown,
            BufferCheckpointRequest: self._checkpoint,
        }

    # -- the conversation ---------------------------------------------------------------

    def handle(self, msg: Message, peer: Peer | None = None) -> Message:
        """Answer one request. ``peer`` is its sender (``relay.transport.sockets.Peer``), who must
        hold the role ``SENDERS`` names for it; None for a caller in this process (tests,
        tools), trusted with every role."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counts["rejected/unexpected_message"] += 1
            return ErrorReply(code="unexpected", detail=f"the buffer does not take "
                                                        f"{type(msg).__name__}")
        if peer is not None:
            refusal = self.roles.admit(peer, SENDERS[type(msg)])
            if refusal:
                self.counts["rejected/forbidden"] += 1
                logger.warning("refused %s from connection %s: %s", type(msg).__name__,
                               peer.identity.hex(), refusal)
                return ErrorReply(code="forbidden", detail=refusal)
        return handler(msg)

    def _attach(self, msg: Attach) -> Message:
        if self.finished:
            return AttachAck(accepted=False, reason=self.end_reason)
        now = self.clock()
        holder = self.registry.holder(msg, now)
        if holder is not None:
            self.counts["rejected/name_in_use"] += 1
            silent_in = holder.last_seen + self.config.heartbeat_timeout_s - now
            reason = (f"the name {msg.generator_id!r} belongs to a live generator (pid "
                      f"{holder.pid} on {holder.host or '?'}, heard from "
                      f"{now - holder.last_seen:.0f} s ago)"
                      + (", of another lineage than this process's" if msg.lineage else "")
                      + "; pick another name")
            logger.warning("refused pid %d on %s: %s", msg.pid, msg.host or "?", reason)
            return AttachAck(accepted=False, reason=reason, retry_after_s=silent_in + 1.0)
        replaced = self.registry.replaced(msg)
        returned = self.leases.release(msg.generator_id)
        self._give_back(returned)  # a restarted generator's leases: its old process's
        if replaced is not None:
            self.counts["generators/replaced"] += 1
            logger.warning("generator %s restarted, replacing pid %d on %s (%d leased "
                           "prompts back in the pool)", msg.generator_id, replaced.pid,
                           replaced.host or "?", len(returned))
        self.registry.attach(msg, now)
        logger.info("generator %s attached (%s on %s of %s, pid %d, weights version %d)",
                    msg.generator_id, msg.engine, msg.device, msg.host, msg.pid, msg.version)
        return AttachAck(accepted=True, learner_version=self.learner_version)

    def _heartbeat(self, msg: Heartbeat) -> Message:
        if self.finished:
            return self._goodbye(msg.generator_id)
        now = self.clock()
        before = self.registry.generators.get(msg.generator_id)
        busy_before = before.generation_seconds if before is not None else 0.0
        known = self.registry.heartbeat(msg, now)
        if known:  # an engine that stepped since the last heartbeat is making progress
            self.leases.renew(msg.generator_id, now,
                              progressed=msg.generation_seconds > busy_before,
                              learner_version=self.learner_version,
                              held=None if msg.leases is None else set(msg.leases))
        return HeartbeatAck(known=known)

    def _detach(self, msg: Detach) -> Message:
        self._drop_generator(msg.generator_id, f"detached ({msg.reason or 'no reason given'})")
        return Ack()

    def _lease(self, msg: LeaseRequest) -> Message:
        """Prompts, as many as the staleness gate admits, to a generator that asks. One that
        holds prompts already waits while another that holds none is asking (``_yields``):
        a busy generator asks between its engine's steps, an idle one every
        ``RETRY_AFTER_S``, and without this the busy one took every slot the gate opened."""
        if self.finished:
            return self._goodbye(msg.generator_id)
        now = self.clock()
        if not self.registry.touch(msg.generator_id, now):
            return ErrorReply(code="not_attached", detail=f"{msg.generator_id} must attach first")
        granted = self.leases.asked_again(msg.generator_id, msg.request_id, now)
        if granted is not None:  # asked again: the reply to the first try was lost
            logger.info("generator %s asked again for lease %s (request %s): sent again",
                        msg.generator_id, granted.lease_id, msg.request_id)
            return self._lease_reply(granted)
        if not self._enough_generators() or self._yields(msg.generator_id, now):
            return self._refuse_lease(msg.generator_id, now)
        max_staleness = self.config.max_staleness
        learner = self._learner_position()
        capacity = lease_capacity(learner, max_staleness=max_staleness, batch_size=self.batch_size,
                                  accepted=self.accepted, running=self.leases.running)
        count = min(msg.max_prompts, self.prompts_per_lease, capacity)
        if count <= 0:
            return self._refuse_lease(msg.generator_id, now)
        prompts = self.source.take(count)
        min_version = lease_min_version(learner, max_staleness=max_staleness,
                                        batch_size=self.batch_size, accepted=self.accepted,
                                        running=self.leases.running, count=len(prompts))
        lease = self.leases.grant(msg.generator_id, prompts, now, min_version, msg.request_id)
        self._idle_refused.pop(msg.generator_id, None)
        self.counts["leases/granted"] += 1
        self.counts["prompts/leased"] += len(prompts)
        return self._lease_reply(lease)

    def _lease_reply(self, lease: Lease) -> PromptLease:
        return PromptLease(lease_id=lease.lease_id, prompts=list(lease.outstanding.values()),
                           n=self.limits.n, min_version=lease.min_version,
                           expires_in_s=self.config.lease_timeout_s,
                           greedy_baseline=self.limits.greedy_baseline)

    def _refuse_lease(self, generator_id: str, now: float) -> PromptLease:
        """No prompts now; ask again after ``RETRY_AFTER_S``."""
        self.counts["leases/gated"] += 1
        if not self.leases.held_by(generator_id):
            self._idle_refused[generator_id] = now
        return PromptLease(lease_id="", retry_after_s=RETRY_AFTER_S)

    def _yields(self, generator_id: str, now: float) -> bool:
        """Whether ``generator_id`` holds prompts while another attached generator holding
        none was refused a lease in the last ``STILL_ASKING_S`` (so still asks: the next
        lease is that one's)."""
        if not self.leases.held_by(generator_id):
            return False
        return any(other != generator_id and now - refused_at <= STILL_ASKING_S
                   and other in self.registry.generators and not self.leases.held_by(other)
                   for other, refused_at in self._idle_refused.items())

    def _enough_generators(self) -> bool:
        """Whether leasing has begun: once ``buffer.min_generators`` were attached together
        (``BufferConfig``), for the rest of the run."""
        if not self._leasing:
            attached = len(self.registry.generators)
            self._leasing = attached >= self.config.min_generators
            if self._leasing and self.config.min_generators > 1:
                logger.info("%d generators attached (buffer.min_generators = %d): leasing "
                            "begins", attached, self.config.min_generators)
        return self._leasing

    def _lease_return(self, msg: LeaseReturn) -> Message:
        prompts = self.leases.give_back(msg.lease_id, msg.prompt_ids, msg.generator_id)
        logger.info("generator %s returned %d prompts of lease %s: %s", msg.generator_id,
                    len(prompts), msg.lease_id, msg.reason or "no reason given")
        self._give_back(prompts)
        return Ack(detail=f"{len(prompts)} prompts back in the pool")

    def _rollout(self, group: RolloutGroup) -> Message:
        """Judge the whole group before its prompt leaves the lease; a group refused after
        that returns its prompt to the pool."""
        self.registry.touch(group.generator_id, self.clock())
        if group.rollout_id in self._recent_ids:
            return self._reject(group, "duplicate")
        prompt = self.leases.peek(group.lease_id, group.prompt_id, group.generator_id)
        if prompt is None:
            return self._reject(group, "unknown_lease")
        problem = group_problem(group, self.limits, self.learner_version)
        self.leases.complete(group.lease_id, group.prompt_id, group.generator_id)
        self.counts["prompts/completed"] += 1
        if problem:
            self.source.give_back([prompt])
            return self._reject(group, "malformed", problem)
        if staleness(group, self.learner_version) > self.config.max_staleness:
            self.source.give_back([prompt])  # regenerate it with fresher weights
            return self._refuse(group, "stale")
        return self._admit(group, prompt)

    def _admit(self, group: RolloutGroup, prompt: Prompt) -> RolloutAck:
        """Hand a sound, fresh group to the store and count what it did; then log it."""
        self._remember(group.rollout_id)
        try:
            admission = self.store.add(group)
        except ReplayFilterError as exc:
            self.counts["groups/failed"] += 1
            return self._fail(group, str(exc))
        except Exception:
            self.counts["groups/store_errors"] += 1
            self.source.give_back([prompt])
            raise
        self.counts["samples/reward_errors"] += sum(1 for s in group.samples if s.reward_error)
        if admission.kept:
            self.accepted += 1
            self._untrained[group.rollout_id] = prompt
            self.counts["groups/accepted"] += 1
            self.counts["samples/filtered"] += len(group.samples) - len(admission.kept_samples)
        else:
            self.source.settle([group.prompt_id])  # dropped for good: a new prompt replaces it
            self.counts[REFUSALS[admission.reason]] += 1
        self._log(group, admission)
        return RolloutAck(rollout_id=group.rollout_id, verdict=admission.reason or "accepted")

    def _log(self, group: RolloutGroup, admission: Admission) -> None:
        """Append the group to the rollout log; a failed write is counted and logged, and
        the group stays as admitted (it is in the store already)."""
        if self.log is None:
            return
        try:
            self.log.append(with_admission(group, admission))
        except OSError as exc:
            self.counts["rollout_log/write_errors"] += 1
            logger.error("rollout log: group %s is %s but could not be written: %s",
                         group.rollout_id, admission.reason or "stored", exc)

    def _sample(self, msg: SampleRequest) -> Message:
        problem = sample_request_problem(msg, self.batch_size, self.total_steps)
        if problem:
            return self._bad_request(msg, problem)
        self.requested_step = max(self.requested_step, msg.step)
        if self._served is not None and msg.step and msg.step == self._served[0]:
            logger.info("the learner asked again for step %d's batch (the reply was lost); "
                        "sent again", msg.step)
            return self._served[1]
        if msg.priorities:
            try:
                self.store.update_priorities(msg.priorities)
            except PriorityError as exc:  # refused whole: nothing was applied
                self.counts["requests/bad_priorities"] += 1
                logger.warning("refused the learner's priorities: %s", exc)
                return ErrorReply(code="bad_priorities", detail=str(exc))
        run_fraction = min(1.0, self.requested_step / max(1, self.total_steps))
        taken = self.store.take(msg.num_groups, self.learner_version, self.config.max_staleness,
                                run_fraction=run_fraction)
        self.source.settle(g.prompt_id for g in taken.groups)
        self.counts["groups/trained"] += sum(
            self._untrained.pop(g.rollout_id, None) is not None for g in taken.groups)
        self._drop_untrained(taken)
        if not taken.groups and (stuck := self._gate_stuck(msg.num_groups)):
            logger.error("the run cannot go on: %s", stuck)
            self.failure, self.finished = stuck, True
        batch = SampleBatch(groups=taken.groups, weights=taken.weights, buffer_stats=self.stats(),
                            retry_after_s=0.0 if taken.groups else RETRY_AFTER_S)
        if taken.groups:
            self.counts["groups/served"] += len(taken.groups)
            self._served = (msg.step, batch)
            self._log_step(msg.step, taken)
            self._dump_step(msg.step, taken)
        return batch

    def _drop_untrained(self, taken: Taken) -> None:
        """Groups that left the store never trained on free their admission slots, so
        replacements are leased; a stale group's prompt is generated again first (with
        fresher weights), an evicted group's after the rest of the epoch."""
        dropped = len(taken.dropped_stale) + len(taken.evicted)
        if not dropped:
            return
        self.accepted -= dropped
        self.counts["dropped/stale"] += dropped
        self.counts["dropped/evicted"] += len(taken.evicted)
        self.source.give_back(self._stored_prompts(taken.dropped_stale))
        self.source.defer(self._stored_prompts(taken.evicted))

    def _stored_prompts(self, groups: list[RolloutGroup]) -> list[Prompt]:
        """The prompts of these untrained groups, which leave ``_untrained``."""
        return [prompt for g in groups if (prompt := self._untrained.pop(g.rollout_id, None))]

    def _log_step(self, step: int, taken: Taken) -> None:
        """Record what learner ``step`` is served (a learner that does not say its step,
        0, is not recorded); a failed write is counted and logged, as for groups."""
        if self.log is None or not step:
            return
        record = StepRecord(step=step, version=self.learner_version,
                            rollout_ids=[g.rollout_id for g in taken.groups],
                            weights=list(taken.weights))
        try:
            self.log.append_step(record)
        except OSError as exc:
            self.counts["rollout_log/write_errors"] += 1
            logger.error("rollout log: the batch of step %d could not be recorded: %s", step, exc)

    def _dump_step(self, step: int, taken: Taken) -> None:
        """Write step ``step``'s samples to ``trainer.rollout_data_dir``
        (``relay.buffer.rollout_dump``; a learner that does not say its step, 0, is not
        dumped); a failed write is counted and logged, and the run goes on."""
        if self.dump is None or not step:
            return
        try:
            write_dump(self.dump.folder, step, taken.groups, self.dump.decode)
        except OSError as exc:
            self.counts["rollout_dump/write_errors"] += 1
            logger.error("trainer.rollout_data_dir: step %d's samples could not be written to "
                         "%s: %s", step, self.dump.folder, exc)

    def _version(self, msg: VersionUpdate) -> Message:
        problem = version_problem(msg, version=self.learner_version, step=self.learner_step,
                                  total_steps=self.total_steps)
        if problem:
            return self._bad_request(msg, problem)
        self.learner_version, self.learner_step = msg.version, msg.step
        return Ack()

    def _learner_position(self) -> LearnerPosition:
        return LearnerPosition(version=self.learner_version, published_step=self.learner_step,
                               requested_step=self.requested_step,
                               steps_per_version=self.steps_per_version)

    def _gate_stuck(self, wanted: int) -> str:
        """Why the learner's batch of ``wanted`` groups, which the store cannot fill, can
        never be formed, or "". With no prompt in flight only a lease can add groups, and a
        healthy gate always admits the batch the learner asks for (``relay.buffer.staleness``:
        the groups counted are at most those of the steps before it, plus fewer than a
        batch stored); a count that fills it was resumed under another batch size."""
        learner = self._learner_position()
        if self.requested_step == 0 or self.leases.running or lease_capacity(
                learner, max_staleness=self.config.max_staleness, batch_size=self.batch_size,
                accepted=self.accepted, running=0) > 0:
            return ""
        return (f"the lease gate is shut for good: the learner waits for step "
                f"{self.requested_step}'s {wanted} groups, the store holds {len(self.store)}, "
                f"no prompt is in flight, and the {self.accepted} groups counted as admitted "
                f"fill every batch up to step {learner.last_batch(self.config.max_staleness)} "
                f"at data.train_batch_size = {self.batch_size}. The count came from the "
                "checkpoint this run resumed from: was it written with another "
                "data.train_batch_size? Resume with that one")

    def _checkpoint(self, msg: BufferCheckpointRequest) -> Message:
        """What a restarted buffer needs (``relay.buffer.prompt_source``, resuming). The groups
        stored and never trained on are discarded on resume (their prompts are pending), so
        they leave the count of accepted groups that the lease gate starts from."""
        self._sync_log(msg.step)
        return BufferCheckpoint(step=msg.step, source=self.source.state(),
                                accepted=self.accepted - len(self._untrained),
                                fingerprint=self.fingerprint)

    def _sync_log(self, step: int) -> None:
        """Make the rollout log durable up to the checkpoint after ``step`` and keep it
        within its size budget (``RolloutLogWriter.checkpointed``); a failure is counted
        and logged (the checkpoint itself does not depend on it)."""
        if self.log is None:
            return
        try:
            self.log.sync()
            self.log.checkpointed(step, self.learner_version)
        except OSError as exc:
            self.counts["rollout_log/write_errors"] += 1
            logger.error("rollout log: could not be synced to disk at a checkpoint: %s", exc)

    def _shutdown(self, msg: Shutdown) -> Message:
        logger.info("the learner ended the run: %s", msg.reason)
        self.finished = True
        return Ack()

    def stop(self, why: str) -> None:
        """An orderly stop from outside the conversation (``relay.buffer.main``: a signal from the
        launcher or the operator): the run is over, and each generator's next request is
        answered with ``Shutdown`` saying ``why``, as when the learner ends the run."""
        if not self.finished:
            logger.info("stopping: %s; every generator is told at its next request", why)
            self.stopped, self.finished = why, True

    # -- timers, bookkeeping ------------------------------------------------------------

    def excuse(self, seconds: float) -> None:
        """The buffer itself did not run for ``seconds``: push back every generator's
        silence clock and every lease deadline by as much, so that heartbeats and groups
        still queued from that time are not judged late."""
        logger.warning("the buffer did not run for %.0f s; generators and leases get that "
                       "time back", seconds)
        self.registry.excuse(seconds)
        self.leases.postpone(seconds)

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
        problems = self.accounting_problems()
        if problems and self._accounting_ok:
            logger.error("the buffer's accounting is off: %s", "; ".join(problems))
        self._accounting_ok = not problems
        self._token_history.append((now, self.registry.generated_tokens))
        while now - self._token_history[0][0] > RATE_WINDOW_S:
            self._token_history.popleft()

    def generator_tokens_per_s(self) -> float:
        """Tokens generated per wall-clock second by all generators, over the last window."""
        if len(self._token_history) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._token_history[0], self._token_history[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _goodbye(self, generator_id: str) -> Shutdown:
        """The run is over: tell the generator, and forget it now (it leaves without
        detaching), so that the buffer need not wait for it to fall silent."""
        if self.registry.forget(generator_id):
            logger.info("generator %s told that %s", generator_id, self.end_reason)
        self._give_back(self.leases.release(generator_id))
        return Shutdown(reason=self.end_reason)

    def _drop_generator(self, generator_id: str, why: str) -> None:
        self._idle_refused.pop(generator_id, None)
        if self.registry.forget(generator_id):
            logger.warning("generator %s %s", generator_id, why)
        self._give_back(self.leases.release(generator_id))

    def _give_back(self, prompts: list[Prompt]) -> None:
        """Leased prompts returned unanswered: back to the pool, counted."""
        self.source.give_back(prompts)
        self.counts["prompts/returned"] += len(prompts)

    def accounting_problems(self) -> list[str]:
        """Each accounting sum (module docstring) that does not hold, with its numbers;
        empty while every prompt and group is accounted for."""
        c, problems = self.counts, []
        in_flight = self.leases.running
        ended = c["prompts/completed"] + c["prompts/returned"] + c["prompts/expired"]
        if c["prompts/leased"] != ended + in_flight:
            problems.append(f"leased {c['prompts/leased']} != completed "
                            f"{c['prompts/completed']} + returned {c['prompts/returned']} + "
                            f"expired {c['prompts/expired']} + in flight {in_flight}")
        answered = c["groups/accepted"] + sum(c[name] for name in ANSWER_OUTCOMES)
        if c["prompts/completed"] != answered:
            outcomes = ", ".join(f"{name} {c[name]}" for name in ANSWER_OUTCOMES)
            problems.append(f"completed {c['prompts/completed']} != accepted "
                            f"{c['groups/accepted']} + {outcomes}")
        stored = len(self._untrained)
        if c["groups/accepted"] != c["groups/trained"] + c["dropped/stale"] + stored:
            problems.append(f"accepted {c['groups/accepted']} != trained {c['groups/trained']} "
                            f"+ dropped stale {c['dropped/stale']} + stored {stored}")
        if stored > len(self.store):
            problems.append(f"{stored} groups never trained on, but the store holds "
                            f"{len(self.store)}")
        return problems

    def _fail(self, group: RolloutGroup, why: str) -> RolloutAck:
        logger.error("the run cannot go on: %s", why)
        self.failure = why
        self.finished = True  # generators are told to stop
        return RolloutAck(rollout_id=group.rollout_id, verdict="run_failed", detail=why)

    def _bad_request(self, msg: Message, detail: str) -> ErrorReply:
        """Refuse a learner request no honest learner sends, with a warning."""
        self.counts["rejected/bad_request"] += 1
        logger.warning("refused %s: %s", type(msg).__name__, detail)
        return ErrorReply(code="bad_request", detail=detail)

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
        if self.failure:
            return f"the run failed: {self.failure}"
        return f"the run was stopped: {self.stopped}" if self.stopped else "the run has finished"

    @property
    def generators(self) -> int:
        return len(self.registry.generators)

    def stats(self) -> dict[str, float]:
        """Gauges and counters for the learner's tracker and the status line."""
        stats = {f"buffer/{k}": float(v) for k, v in self.counts.items()}
        stats.update({f"buffer/{k}": v for k, v in self.store.stats().items()})
        stats.update({
            "buffer/occupancy": float(len(self.store)),
            "buffer/groups/stored": float(len(self._untrained)),
            "buffer/accounting_problems": float(len(self.accounting_problems())),
            "buffer/running_prompts": float(self.leases.running),
            "buffer/pool_prompts": float(self.source.returned),
            "buffer/deferred_prompts": float(self.source.deferred),
            "buffer/accepted_live": float(self.accepted),
            "buffer/evicted_frac": self.counts["dropped/evicted"] / max(
                1, self.counts["groups/accepted"]),
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
