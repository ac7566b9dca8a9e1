"""A generator's work loop: lease prompts, keep the engine's batch full, hand groups on.

The compute loop runs the engine one ``step`` at a time (continuous batching: a lean
engine admits new prompts as others finish). Between steps it leases more prompts when a
whole lease fits in the engine's free slots (``rollout.max_num_seqs``), applies staged
weights at that safe point, and hands every finished prompt, decoded to text, to the
``GroupSender`` thread, which scores and sends it while generation goes on. A
``Heartbeater`` thread keeps the membership alive and names the leases the generator holds
(until their last group is sent): the buffer renews only those, so a lease whose reply was
lost expires back into the pool; a lease request is named (``request_id``), so its retry
gets the lease granted for it. A ``WeightReceiver`` thread stages new weights.

A lease that starts on an idle engine first restarts the engine's random stream at a seed
drawn from the generator's seed and the lease's first prompt id (``lease_seed``): what a
generator samples then depends on the prompts, not on what it sampled before, so a resumed
run, whose generators start afresh, draws the tokens an uninterrupted run draws (at eta = 0,
where each step's leases start together on an idle engine).

A lease waits, beside the work in flight, until the weights it needs (``min_version``)
have arrived; if they never do, or generation fails, its unsent prompts are returned to
the buffer so they go to another generator. A generator stopped by a signal sends what
it finished and returns the rest. One that the buffer tells the run is over (``Shutdown``,
the answer to its next heartbeat or lease request once the run ends or is stopped) logs the
reason and leaves within seconds; one that finds the buffer gone without that word keeps
asking for ``buffer.client_patience_s``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from relay.algorithms.rewards.scorer import RewardScorer
from relay.configs.prompt_data import CutSide, cut_side, truncate_prompt
from relay.configs.run_schema import BufferConfig, DataConfig, OverlongBufferConfig, RolloutConfig
from relay.generators.engine import Engine, FinishedGroup
from relay.generators.judge import Judge
from relay.generators.leases import HeldLease, HeldLeases
from relay.generators.reward_client import RemoteJudge, RemoteRewardModel
from relay.generators.reward_model import RewardModelScorer
from relay.generators.sampling import SamplingParams
from relay.generators.sender import Counters, FinishedPrompt, GroupSender, decode_all
from relay.generators.tool_loop import ConfiguredWorkflow
from relay.generators.weight_receiver import StagedWeights, WeightReceiver
from relay.generators.workflow import EpisodeRow, WorkflowRunner
from relay.transport.messages import (
    HEARTBEAT_EVERY_S,
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
    Shutdown,
)
from relay.transport.retry import patient_request
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client, PeerTimeout
from relay.transport.threads import WatchedThread

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
# once the run is over, how long a background thread's request in progress (a group being
# sent, a heartbeat, a weight poll) may take before the process leaves without it: the
# peers may be gone already, and the threads are daemons
RUN_OVER_WAIT_S = 2.0
REPORT_EVERY_S = 30.0  # how often the loop logs its throughput and batch occupancy
EPISODES_PER_SLOT = 2  # workflow episodes alive per engine slot: those awaiting tools hold none
_KEPT: dict[CutSide, str] = {"left": "last", "right": "first", "middle": "first and last"}


class NameInUse(RuntimeError):
    """Another live generator holds this generator's name at the buffer."""


def sampling_params(rollout: RolloutConfig) -> SamplingParams:
    """The engine's sampling parameters for training rollouts."""
    return SamplingParams(max_new_tokens=rollout.response_length,
                          temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k)


def lease_seed(base: int, prompt_id: str) -> int:
    """A 63-bit seed from the generator's seed and a prompt id."""
    digest = hashlib.blake2b(f"{base}/{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Heartbeater:
    """Sends heartbeats, naming the leases ``held`` returns (the buffer renews only those);
    notices a forgotten membership and the end of the run."""

    def __init__(self, generator_id: str, buffer_endpoint: str, engine: Engine,
                 counters: Counters, keys: ClientKeys | None,
                 held: Callable[[], Sequence[str]]) -> None:
        self._generator_id, self._buffer_endpoint = generator_id, buffer_endpoint
        self._engine, self._counters, self._keys = engine, counters, keys
        self._held = held
        self.stop_requested = threading.Event()
        self.reattach = threading.Event()
        self._done = threading.Event()
        self._thread = WatchedThread(self._run, "heartbeat")

    def start(self) -> Heartbeater:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self._done.set()
        self._thread.join(timeout_s)

    def raise_if_died(self) -> None:
        self._thread.raise_if_died()

    def _run(self) -> None:
        client = Client(self._buffer_endpoint, keys=self._keys)
        try:
            while not self._done.wait(HEARTBEAT_EVERY_S):
                beat = Heartbeat(generator_id=self._generator_id,
                                 version=self._engine.version,
                                 generated_tokens=self._counters.tokens,
                                 generation_seconds=self._counters.seconds,
                                 leases=list(self._held()))
                try:
                    reply = client.request(beat, REQUEST_TIMEOUT_S)
                except PeerTimeout:
                    logger.warning("the buffer did not answer a heartbeat")
                    continue
                if isinstance(reply, Shutdown):
                    logger.info("the buffer ended the run: %s; leaving", reply.reason)
                    self.stop_requested.set()
                    return  # the buffer is about to go: a later heartbeat would hang
                if isinstance(reply, HeartbeatAck) and not reply.known:
                    self.reattach.set()
        finally:
            client.close()


class GeneratorLoop:
    """The compute loop of one generator process.

    It reads the run's sections: ``rollout`` (sampling, batch, lease size), ``data`` (the
    prompt length limit and how to cut a longer prompt), ``buffer`` (how long to retry a
    silent buffer, ``client_patience_s``, and how long a lease may wait for its weights,
    ``weights_timeout_s``, 0 meaning ``lease_timeout_s``) and ``overlong`` (DAPO's overlong
    penalty, ``reward_model.overlong_buffer``); ``reward_model`` (``reward_model.enable``)
    or ``judge`` (``reward_model.judge``) scores each group beside the reward function
    (``relay.generators.reward_model``, ``relay.generators.judge``). An
    unexpected death of the heartbeat or weight-receiving thread stops the loop with
    ``ThreadDied`` naming it.

    With a ``workflow`` (``rollout.workflow``, or the multi-turn tool loop) each sample is an
    episode that a ``WorkflowRunner`` plays: the loop hands the episodes' turns to the engine
    and their results back, and an episode awaiting a tool holds no engine slot, so the
    loop leases more prompts while episodes wait (up to ``EPISODES_PER_SLOT`` episodes per
    ``max_num_seqs`` slot) and the batch stays full.
    """

    def __init__(self, *, generator_id: str, buffer_endpoint: str, weights_endpoint: str,
                 weights_stream_endpoint: str, engine: Engine, tokenizer, scorer: RewardScorer,
                 rollout: RolloutConfig, data: DataConfig, buffer: BufferConfig,
                 overlong: OverlongBufferConfig, seed: int = 0,
                 keys: ClientKeys | None = None,
                 workflow: ConfiguredWorkflow | None = None, lineage: str = "",
                 reward_model: RewardModelScorer | RemoteRewardModel | None = None,
                 judge: Judge | RemoteJudge | None = None) -> None:
        self.generator_id, self.buffer_endpoint = generator_id, buffer_endpoint
        self.lineage = lineage  # the launcher's token for its restarts; "" attached by hand
        self.engine, self.tokenizer = engine, tokenizer
        self.workflow = workflow
        self.episodes = None if workflow is None else WorkflowRunner(
            workflow.function, tokenizer=tokenizer, response_length=rollout.response_length,
            engine_version=lambda: engine.version, name=workflow.name)
        self.params = sampling_params(rollout)
        self.greedy_params = msgspec.structs.replace(self.params, temperature=0.0)
        self.max_num_seqs = rollout.max_num_seqs
        self.max_prompt_length = data.max_prompt_length
        self.truncation_side = cut_side(data.truncation)
        self.weights_timeout_s = buffer.weights_timeout_s or buffer.lease_timeout_s
        self.patience_s = buffer.client_patience_s  # retrying a buffer that does not answer
        self.counters = Counters()
        self.leases = HeldLeases()
        self.seed = seed  # the generator's own; each lease on an idle engine derives one
        self._buffer = Client(buffer_endpoint, keys=keys)
        self._weights = WeightReceiver(weights_endpoint, weights_stream_endpoint,
                                       generator_id, keys=keys,
                                       staging_device=engine.staging_device)
        # the leases the heartbeats name: updated by the compute loop, read by the heartbeat
        # thread (a tuple, replaced whole); a lease stays held until its last group is sent
        self._held: tuple[str, ...] = ()
        self._sending: dict[str, int] = {}  # lease id: groups handed on when its last went
        self._handed_on = 0
        self._heart = Heartbeater(generator_id, buffer_endpoint, engine, self.counters, keys,
                                  held=lambda: self._held)
        self.sender = GroupSender(generator_id=generator_id, buffer_endpoint=buffer_endpoint,
                                  scorer=scorer, counters=self.counters,
                                  max_new_tokens=rollout.response_length, overlong=overlong,
                                  patience_s=self.patience_s, keys=keys,
                                  reward_model=reward_model, judge=judge)
        self._next_lease_at = 0.0
        # engine sequences per prompt and per lease; each lease corrects them (n, baseline)
        self._sequences_per_prompt = rollout.n
        self._lease_sequences = rollout.n * rollout.prompts_per_lease
        self._occupied = self._steps = 0
        self._next_report_at = time.monotonic() + REPORT_EVERY_S
        # the first lease and the first version from the learner are logged at INFO
        self._leased_any = self._loaded_any = False

    # -- lifecycle ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Work until ``stop`` is set or the buffer says the run is over."""
        if not self._attach():
            return
        self._weights.start(self.engine.version)
        self._heart.start()
        self.sender.start()
        try:
            while not self._stopping(stop):
                if self._heart.reattach.is_set():
                    self._heart.reattach.clear()
                    if not self._attach():
                        return
                self.sender.raise_if_failed()
                self._heart.raise_if_died()
                self._weights.raise_if_died()
                self._work_once(stop)
                self._held = self.held_lease_ids()
        except BaseException:
            self._give_back_all("generation failed")
            raise
        finally:
            if self._heart.stop_requested.is_set():  # the run is over: nobody wants the
                # groups, the buffer forgets every generator itself, and may be gone already
                self.sender.stop(discard=True, timeout_s=RUN_OVER_WAIT_S)
                self._heart.stop(RUN_OVER_WAIT_S)
                self._weights.stop(RUN_OVER_WAIT_S)
            else:
                self.sender.stop()
                if stop.is_set():
                    self._give_back_all("the generator is stopping")
                self._heart.stop()
                self._weights.stop()
                self._detach()
            self._buffer.close()
            if self.episodes is not None:
                self.episodes.close()

    def _stopping(self, stop: threading.Event) -> bool:
        return stop.is_set() or self._heart.stop_requested.is_set()

    def _attach(self) -> bool:
        """Attach; False when the run is over.

        A refusal with ``retry_after_s`` says another live process holds this name. That
        may be this generator's own earlier process, dead but not yet declared silent (a
        generator restarted under its topology name): the attach is tried once more after
        ``retry_after_s``, when the buffer will have declared a dead holder silent (at most
        ``buffer.heartbeat_timeout_s`` and a second). Refused again, the holder is alive:
        ``NameInUse``. A generator the launcher started again carries the lineage of the
        process it replaces (``lineage``): the buffer gives it the name at once when a
        process of that lineage holds it."""
        attach = Attach(generator_id=self.generator_id, engine=self.engine.name,
                        device=str(getattr(self.engine, "device", "")),
                        host=socket.gethostname(), pid=os.getpid(), version=self.engine.version,
                        lineage=self.lineage)
        reply = patient_request(self._buffer, attach, REQUEST_TIMEOUT_S, self.patience_s)
        if isinstance(reply, AttachAck) and reply.retry_after_s > 0:
            logger.warning("not attached yet: %s; trying again in %.0f s, when the buffer will "
                           "have declared that process silent if it is gone", reply.reason,
                           reply.retry_after_s)
            time.sleep(reply.retry_after_s)
            reply = patient_request(self._buffer, attach, REQUEST_TIMEOUT_S, self.patience_s)
            if isinstance(reply, AttachAck) and reply.retry_after_s > 0:
                raise NameInUse(reply.reason)
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

    # -- one turn of the loop -----------------------------------------------------------

    def _work_once(self, stop: threading.Event) -> None:
        """Lease if a lease fits, start the leases whose weights are here, run one engine
        step (or, with nothing to run, wait for weights or for the next lease)."""
        self._lease_if_room()
        self.apply_staged_weights()
        self._start_ready_leases()
        episodes = self.episodes
        if episodes is not None:
            for group in episodes.finished():
                self._collect(group)
            episodes.submit_turns(self.engine)
        if self.engine.in_flight:
            began = time.perf_counter()
            finished = self.engine.step(between_steps=self.apply_staged_weights)
            self.counters.seconds += time.perf_counter() - began
            self._occupied += self.engine.in_flight
            self._steps += 1
            for group in finished:
                self.counters.tokens += sum(c.token_ids.numel() for c in group.completions)
                if episodes is None or not episodes.take_turn(group):
                    self._collect(group)
            self._report()
        elif episodes is not None and episodes.live:
            episodes.wait(0.5)  # every episode awaits a tool: until one asks for a turn
        elif self.leases.waiting:
            self._wait_for_weights()
        else:
            stop.wait(max(0.0, self._next_lease_at - time.monotonic()))

    def _lease_if_room(self) -> None:
        """Ask for prompts while a whole lease's sequences fit beside the work in flight
        (any lease at all when the engine is idle), until the buffer has none to give."""
        while time.monotonic() >= self._next_lease_at and not self._heart.stop_requested.is_set():
            free = self.max_num_seqs - self._busy_slots() - self.leases.waiting_sequences
            busy = self.engine.in_flight or self.leases.waiting or self._live_episodes()
            if free < self._sequences_per_prompt or (busy and free < self._lease_sequences):
                return
            if not self._lease(max_prompts=free // self._sequences_per_prompt):
                return

    def _busy_slots(self) -> int:
        """Engine slots taken: the sequences in flight; with a workflow, also its episodes
        beyond what the slots can keep waiting (``EPISODES_PER_SLOT``)."""
        if self.episodes is None:
            return self.engine.in_flight
        live = self.episodes.live
        return max(live - self.episodes.off_engine,
                   live - (EPISODES_PER_SLOT - 1) * self.max_num_seqs)

    def _live_episodes(self) -> int:
        return 0 if self.episodes is None else self.episodes.live

    def _lease(self, max_prompts: int) -> bool:
        """One lease request, named so that a retry after a lost reply gets the lease the
        buffer granted for it; True when prompts came."""
        request = LeaseRequest(generator_id=self.generator_id, max_prompts=max_prompts,
                               request_id=secrets.token_hex(8))
        reply = patient_request(self._buffer, request, REQUEST_TIMEOUT_S, self.patience_s)
        if isinstance(reply, Shutdown):
            logger.info("the buffer ended the run: %s; leaving", reply.reason)
            self._heart.stop_requested.set()
        elif isinstance(reply, ErrorReply) and reply.code == "not_attached":
            self._heart.reattach.set()
        elif isinstance(reply, PromptLease) and reply.prompts:
            first, self._leased_any = not self._leased_any, True
            logger.log(logging.INFO if first else logging.DEBUG,  # one a few seconds: DEBUG
                       "lease %s: %d prompts x %d samples%s", reply.lease_id,
                       len(reply.prompts), reply.n,
                       "; later leases are logged at DEBUG" if first else "")
            self._sequences_per_prompt = reply.n + (1 if reply.greedy_baseline else 0)
            self._lease_sequences = self._sequences_per_prompt * len(reply.prompts)
            self.leases.hold(HeldLease(reply, [self._tokenize(p) for p in reply.prompts]))
            self._held = self.held_lease_ids()
            return True
        elif isinstance(reply, PromptLease):
            self._next_lease_at = time.monotonic() + reply.retry_after_s
        else:
            raise RuntimeError(f"unexpected reply to a lease request: {reply!r}")
        return False

    def _start_ready_leases(self) -> None:
        """Submit the waiting leases whose weights the engine holds; return those that
        waited past ``weights_timeout_s``."""
        now = time.monotonic()
        for held in list(self.leases.waiting):
            if self.engine.version >= held.lease.min_version:
                self.leases.start(held)
                if not self.engine.in_flight and not self._live_episodes():
                    self.engine.reseed(lease_seed(self.seed, held.lease.prompts[0].prompt_id))
                for request in held.requests(self.params, self.greedy_params):
                    if self.episodes is None:
                        self.engine.submit(request)
                    else:
                        self.episodes.start(request, episode_row(held, request.key[1]))
            elif now - held.leased_at > self.weights_timeout_s:
                self.leases.forget(held)
                self._give_back(held, f"weights version {held.lease.min_version} never arrived")

    def _wait_for_weights(self) -> None:
        """Idle with leases waiting: block briefly for the oldest lease's weights."""
        needed = min(h.lease.min_version for h in self.leases.waiting)
        with self._weights.handover(at_least=needed, wait_s=0.5) as staged:
            self._load(staged)

    def _collect(self, group: FinishedGroup) -> None:
        """Record a finished group; hand its prompt on once the prompt is done."""
        done = self.leases.finish(group)
        if done is None:
            return
        held, index = done
        lease, prompt = held.lease, held.lease.prompts[index]
        took = time.monotonic() - held.leased_at
        if took > lease.expires_in_s and not held.warned_late:
            held.warned_late = True
            logger.warning("lease %s took %.0f s, past its %.0f s expiry: the buffer has "
                           "leased its prompts again and will refuse these groups (raise "
                           "buffer.lease_timeout_s)", lease.lease_id, took, lease.expires_in_s)
        greedy = held.greedy.get(index)
        completions = held.sampled.pop(index)
        self.sender.put(FinishedPrompt(
            rollout_id=f"{lease.lease_id}/{prompt.prompt_id}", lease_id=lease.lease_id,
            prompt=prompt, prompt_ids=held.prompt_ids[index], completions=completions,
            texts=decode_all(self.tokenizer, completions), greedy=greedy,
            greedy_text=decode_all(self.tokenizer, [greedy])[0] if greedy else ""))
        self._handed_on += 1
        if held.done:
            self._sending[lease.lease_id] = self._handed_on

    def held_lease_ids(self) -> tuple[str, ...]:
        """The leases this generator holds: waiting for weights, generating, or with a
        group the sender has not sent yet (it sends in order, counting each group it is
        done with as sent or refused)."""
        done = self.counters.groups_sent + self.counters.groups_rejected
        self._sending = {lid: last for lid, last in self._sending.items() if last > done}
        return (*(h.lease.lease_id for h in self.leases.all()), *self._sending)

    def _report(self) -> None:
        now = time.monotonic()
        if now < self._next_report_at or not self._steps:
            return
        logger.info("%.0f tokens/s of generation; %.0f sequences in flight per step on "
                    "average (max_num_seqs %d); %d groups sent, %d refused",
                    self.counters.tokens / max(self.counters.seconds, 1e-9),
                    self._occupied / self._steps, self.max_num_seqs,
                    self.counters.groups_sent, self.counters.groups_rejected)
        self._next_report_at = now + REPORT_EVERY_S

    def _tokenize(self, prompt: Prompt) -> list[int]:
        render = None if self.workflow is None else self.workflow.render_prompt
        ids = render(self.tokenizer, prompt.messages) if render is not None else \
            self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        limit = self.max_prompt_length
        if len(ids) > limit:
            logger.warning("prompt %s has %d tokens; keeping the %s %d (data.max_prompt_length, "
                           "data.truncation)", prompt.prompt_id, len(ids),
                           _KEPT[self.truncation_side], limit)
        return truncate_prompt(ids, limit, self.truncation_side)

    # -- returning prompts --------------------------------------------------------------

    def _give_back(self, held: HeldLease, reason: str, patience_s: float | None = None) -> None:
        """Return a lease's unsent prompts, retried through a buffer stall for
        ``patience_s`` (default ``buffer.client_patience_s``)."""
        logger.warning("returning lease %s: %s", held.lease.lease_id, reason)
        patient_request(self._buffer, LeaseReturn(generator_id=self.generator_id,
                                                  lease_id=held.lease.lease_id,
                                                  prompt_ids=held.unsent_prompt_ids,
                                                  reason=reason),
                        REQUEST_TIMEOUT_S, self.patience_s if patience_s is None else patience_s)

    def _give_back_all(self, reason: str) -> None:
        """Return the unsent prompts of every lease held (best effort: the buffer may be
        gone)."""
        for held in self.leases.clear():
            try:
                self._give_back(held, reason, patience_s=REQUEST_TIMEOUT_S)  # one try
            except PeerTimeout:
                logger.warning("could not return lease %s: the buffer did not answer",
                               held.lease.lease_id)
                return

    # -- weights ------------------------------------------------------------------------

    def apply_staged_weights(self) -> None:
        """Load a staged version if one is waiting (the safe-point hook)."""
        with self._weights.handover() as staged:
            self._load(staged)

    def _load(self, staged: StagedWeights | None) -> None:
        """Load ``staged`` if it is newer than the engine's weights; logged at INFO the
        first time (the learner's weights reach this generator), at DEBUG after (a line
        per version would flood the log)."""
        if staged is not None and staged.version > self.engine.version:
            first, self._loaded_any = not self._loaded_any, True
            self.engine.load_weights(staged.version, staged.tensors)
            logger.log(logging.INFO if first else logging.DEBUG,
                       "now generating with weights version %d (%d sequences in flight)%s",
                       staged.version, self.engine.in_flight,
                       "; later versions are logged at DEBUG" if first else "")


def episode_row(held: HeldLease, index: int) -> EpisodeRow:
    """Prompt ``index`` of a lease as a workflow's episodes see it."""
    prompt = held.lease.prompts[index]
    return EpisodeRow(prompt_id=prompt.prompt_id, messages=prompt.messages,
                      data_source=prompt.data_source, ground_truth=prompt.ground_truth,
                      extra_info=prompt.extra_info, prompt_ids=held.prompt_ids[index],
                      sample_index=0)
