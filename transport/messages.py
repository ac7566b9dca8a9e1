"""Every message that crosses a process boundary in Relay, in one module.

A message is a tagged ``msgspec.Struct`` (the tag is the class name in snake case, see
``Message``). On the wire it travels as a multipart ZeroMQ message (``relay.transport.codec``):

    frame 0   preamble: b"RLY" + protocol version (one byte)
    frame 1   the struct, msgpack-encoded as an array [tag, field, field, ...]
    frame 2+  raw tensor bytes, one frame per large tensor, referenced from frame 1

(Request-reply puts one envelope frame, the request id, in front: see ``relay.transport.sockets``.)

Rules that keep old and new peers talking:
- fields are only appended, always with a default;
- a change that breaks decoding bumps ``PROTOCOL_VERSION`` (a peer with another version is
  rejected and counted, never mis-decoded);
- tensors are ``torch.Tensor`` fields; the codec turns them into raw frames, never pickle.

This module knows the shapes of the conversation, not who speaks when: see ``relay.buffer.hub``
(generators and the learner with the buffer), ``relay.generators.process`` (a generator's side),
``relay.learner.weights`` with ``relay.generators.weight_receiver`` (weight versions), and
``relay.learner.eval_queue`` with ``relay.generators.evaluator`` (held-out evaluation of published
versions), and ``relay.generators.reward_client`` with ``relay.generators.reward_server`` (scores from
a ``[[reward_models]]`` process).

Choices are closed sets (``Literal``): a peer that sends an error code or a verdict this
module does not list is rejected like any malformed message.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
import torch

PROTOCOL_VERSION = 4  # 4: reward servers' ScoreRequest / ScoreReply; 3: weight row pieces

WireErrorKind = Literal["envelope", "preamble", "version", "malformed", "schema", "tensor"]
"""Why a receiver rejected a frame set (``relay.transport.codec``)."""
ErrorCode = Literal[WireErrorKind, "handler", "unexpected", "not_attached", "bad_priorities",
                    "forbidden", "bad_request"]
"""``ErrorReply.code``: a wire error kind; ``handler``: the server failed on a sound
request; ``unexpected``: this server does not take that message; ``not_attached``: a
generator must attach before it leases; ``bad_priorities``: replay priorities the buffer
cannot use; ``forbidden``: the sender's role may not send that message (``relay.transport.roles``);
``bad_request``: a value no honest peer sends (a batch of -1 groups, a version from the
future)."""
RolloutVerdict = Literal["accepted", "duplicate", "unknown_lease", "malformed", "stale",
                         "zero_variance", "run_failed"]
"""What the buffer did with a ``RolloutGroup``: kept it, or why not (``zero_variance``: DAPO
dynamic sampling dropped it; ``run_failed``: a replay filter ended the run)."""


class Message(
    msgspec.Struct,
    tag=lambda name: "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_"),
    array_like=True,
    omit_defaults=True,
    kw_only=True,
    gc=False,
):
    """Base class of every wire message; the tag is the class name in snake case."""


# ---------------------------------------------------------------------------------------
# Generator membership: attach / heartbeat / detach
# ---------------------------------------------------------------------------------------


class Attach(Message):
    """A generator announces itself to the buffer. ``lineage`` (not empty): the token the
    launcher gives every start of one topology generator, the same across its restarts and
    drawn anew per launch; a process of the lineage that holds the name may be taken over
    (the launcher starts one only after the last died: ``relay.buffer.registry``). Empty
    for a generator attached by hand."""

    generator_id: str
    engine: str
    device: str
    host: str = ""
    pid: int = 0
    version: int = 0  # weight version the generator holds right now
    lineage: str = ""


class AttachAck(Message):
    """The buffer's answer to ``Attach``: accepted (with the learner's current version) or
    refused, and why. ``retry_after_s`` > 0: refused for now, because another live process
    holds the name; it is free once that one falls silent, which is no sooner than this."""

    accepted: bool
    learner_version: int = 0
    reason: str = ""
    retry_after_s: float = 0.0


HEARTBEAT_EVERY_S = 1.0
"""How often a generator sends ``Heartbeat`` (``relay.generators.process``): the buffer's stop
drains for two of these, so that every attached generator asks once more and hears the run is
over (``relay.buffer.main``)."""


class Heartbeat(Message):
    """Periodic liveness signal, carrying the generator's throughput counters and the ids
    of the leases it holds (``leases``: only those are renewed; None, from a generator that
    does not say, renews all of its leases)."""

    generator_id: str
    version: int
    generated_tokens: int = 0  # cumulative since attach
    generation_seconds: float = 0.0  # cumulative busy time since attach
    leases: list[str] | None = None


class HeartbeatAck(Message):
    """Reply to ``Heartbeat``; ``known=False`` asks the generator to attach again."""

    known: bool


class Detach(Message):
    """A generator leaves; the buffer returns its leases to the pool at once."""

    generator_id: str
    reason: str = ""


# ---------------------------------------------------------------------------------------
# Prompt leases
# ---------------------------------------------------------------------------------------


class Prompt(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True, gc=False):
    """One dataset row as the generator needs it (verl's schema, already validated)."""

    prompt_id: str
    messages: list[dict[str, str]]  # chat messages: [{"role": ..., "content": ...}]
    data_source: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = {}


class LeaseRequest(Message):
    """A generator asks for up to ``max_prompts`` prompts. ``request_id`` names the request
    across its retries: asked again after a lost reply, the buffer sends the lease it
    granted (``""``: every request is new)."""

    generator_id: str
    max_prompts: int
    request_id: str = ""


class PromptLease(Message):
    """Prompts leased to one generator.

    ``n`` samples are to be drawn per prompt with weights of at least ``min_version``. An
    empty lease means "nothing now" (staleness gate closed or data exhausted); retry after
    ``retry_after_s``. Leases not answered within ``expires_in_s`` return to the pool. With
    ``greedy_baseline`` (ReMax) the generator also decodes one greedy response per prompt
    and sends its reward as the group's ``baseline_reward``.
    """

    lease_id: str
    prompts: list[Prompt] = []
    n: int = 1
    min_version: int = 0
    expires_in_s: float = 0.0
    retry_after_s: float = 0.0
    greedy_baseline: bool = False


class LeaseReturn(Message):
    """A generator gives prompts back unanswered (shutting down, engine error)."""

    generator_id: str
    lease_id: str
    prompt_ids: list[str]
    reason: str = ""


# ---------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------


class EpisodeStats(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True,
                   gc=False):
    """What one multi-turn episode did: its assistant turns, its tool calls (failed and
    malformed ones included, ``tool_failures`` of them) and each call's wall time."""

    turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0
    tool_latencies_s: list[float] = []


class Sample(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True, gc=False):
    """One completion of a prompt, with what the learner needs to train on it.

    Shapes: ``prompt_ids`` (P,) int32; ``response_ids``, ``logprobs`` (behavior log-probs
    of the sampled tokens under the processed sampling distribution) and ``versions``
    (policy version that produced each token) are (R,), int32 / float32 / int32.

    A multi-turn episode is one sample: ``response_ids`` is everything after the prompt,
    the policy's turns and the tokens inserted between them (tool responses, the chat
    template's turn markers). ``loss_mask`` (R,) bool is True on the tokens the policy
    sampled, False on inserted ones (None: every token was sampled). On an inserted token
    ``logprobs`` is 0 and ``versions`` the engine's version when it was inserted (so the
    oldest version of a sample is still its oldest policy token's or older); the learner
    trains on the masked tokens only. ``episode`` says what the episode did (None for a
    single-turn sample).
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    reward: float
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    reward_info: dict[str, float] = {}
    reward_error: str = ""  # why the reward function failed (reward is then 0)
    text: str = ""  # decoded response, for logs and offline inspection
    loss_mask: torch.Tensor | None = None
    episode: EpisodeStats | None = None


class RolloutGroup(Message):
    """All ``n`` samples for one leased prompt; ``rollout_id`` is unique per group.

    ``baseline_reward`` is the reward of the greedy response to the prompt when the lease
    asked for it (ReMax's baseline; the response's text is in ``metadata["greedy_text"]``).
    """

    rollout_id: str
    lease_id: str
    prompt_id: str
    generator_id: str
    samples: list[Sample]
    data_source: str = ""
    ground_truth: Any = None
    metadata: dict[str, Any] = {}
    baseline_reward: float | None = None


class RolloutAck(Message):
    """The buffer's verdict on one ``RolloutGroup``; ``detail`` explains a refusal."""

    rollout_id: str
    verdict: RolloutVerdict
    detail: str = ""

    @property
    def accepted(self) -> bool:
        return self.verdict == "accepted"


# ---------------------------------------------------------------------------------------
# Learner <-> buffer
# ---------------------------------------------------------------------------------------


class SampleRequest(Message):
    """The learner asks for a batch of ``num_groups`` groups for learner step ``step``
    (counted from 1; 0: not said). Its version reaches the buffer by ``VersionUpdate``.

    ``priorities`` carries the replay priorities (by rollout id) the learner measured on
    its last batch, for prioritized replay by TD-error; empty otherwise. A request repeated
    for the step last served (its reply was lost) gets the same batch again.
    """

    num_groups: int
    priorities: dict[str, float] = {}
    step: int = 0


class SampleBatch(Message):
    """A batch for the learner, or none yet (``groups`` empty; retry after a pause).

    ``buffer_stats`` carries the buffer's gauges and counters for the learner to log
    (occupancy, drops by reason, generator throughput). ``weights`` holds each group's
    importance weight under prioritized replay (empty: all 1).
    """

    groups: list[RolloutGroup] = []
    weights: list[float] = []
    retry_after_s: float = 0.0
    buffer_stats: dict[str, float] = {}


class VersionUpdate(Message):
    """The learner tells the buffer that weight ``version`` is published, after ``step``:
    the one channel by which the buffer learns the learner's version."""

    version: int
    step: int = 0


class BufferCheckpointRequest(Message):
    """The learner is checkpointing after ``step`` and asks for what a restarted buffer needs
    to go on from there (``BufferCheckpoint``)."""

    step: int


class PromptSourceState(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True,
                        gc=False):
    """Where the buffer's prompt stream stands (``relay.buffer.prompt_source``): the epoch, the
    data loader's ``state_dict`` (it may hold tensors: the shuffle's generator) and every
    prompt handed out and not yet trained on or dropped, in the order first handed out."""

    epoch: int
    loader: dict[str, Any]
    pending: list[Prompt] = []


class BufferCheckpoint(Message):
    """The buffer's answer to ``BufferCheckpointRequest``: its prompt stream, and
    ``accepted``, the groups it admitted less those still waiting in its store (a restarted
    buffer discards stored groups and leases their prompts again): the count its lease gate
    starts from on resume. ``fingerprint``: the config values both mean something under, by
    key (``relay.buffer.fingerprint``; empty in a checkpoint written before it existed)."""

    step: int
    source: PromptSourceState
    accepted: int = 0
    fingerprint: dict[str, str | int | bool] = {}


# ---------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------


class WeightRequest(Message):
    """A generator (or the evaluator) asks the weight server which version is newest.

    The reply is a ``WeightManifest`` without buckets naming that version: versions travel
    on the learner's weight stream (``relay.learner.weights``), not in replies. ``resend``: the
    sender is behind and heard no stream of the newest version (it subscribed late, or
    lost a piece), so it asks the learner to stream it again.
    """

    generator_id: str
    have_version: int
    resend: bool = False


class WeightEntry(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """One parameter of a version: its name, dtype and shape as the engine loads it."""

    name: str
    dtype: str
    shape: list[int]


class WeightManifest(Message):
    """Announces a complete weight version; ``num_buckets`` ``WeightBucket``s follow it on
    the weight stream.

    Without buckets it only names a version: the newest one (answering a
    ``WeightRequest``), or the one offered for evaluation (answering an ``EvalRequest``).
    ``step`` is the learner step after which these weights were taken.
    """

    version: int
    entries: list[WeightEntry] = []
    num_buckets: int = 0
    total_bytes: int = 0
    step: int = 0


class WeightBucket(Message):
    """Bucket ``index`` of a version: pieces of parameters, in manifest order.

    Piece ``i`` holds rows ``starts[i]`` to ``starts[i] + len(tensors[i])`` (along the
    first dimension) of parameter ``names[i]``; a parameter larger than a bucket arrives as
    several pieces in consecutive buckets, a small one as one piece starting at row 0.
    """

    version: int
    index: int
    names: list[str]
    starts: list[int]
    tensors: list[torch.Tensor]


class EvalOffer(Message):
    """On the weight stream, after a version: the learner offers the weights it had after
    ``step``, published as ``version``, for held-out evaluation. The evaluator keeps that
    version until it has evaluated it (``relay.generators.evaluator``); version 0 is the initial
    checkpoint, which it loaded itself."""

    step: int
    version: int


class StreamBeacon(Message):
    """On the weight stream while the learner waits for the evaluator's first request, a
    few times a second: nothing to apply. A subscriber that hears it knows its subscription
    reached the learner, so nothing streamed from then on goes by unheard
    (``relay.generators.weight_receiver``)."""


class ValGeneration(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """One held-out response (``trainer.log_val_generations``): the prompt as the model saw
    it, the response, and its reward."""

    input: str
    output: str
    score: float


class EvalReport(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """Held-out metrics (``eval/...``) of the weights the learner had after ``step``, and
    ``trainer.log_val_generations`` responses (verl's seeded sample of them)."""

    step: int
    version: int
    metrics: dict[str, float]
    generations: list[ValGeneration] = []


class EvalRequest(Message):
    """The evaluator asks the learner for the next weights to evaluate, taken after a step
    later than ``after_step``, and hands in the report of the last ones it evaluated.

    Replies: a ``WeightManifest`` without buckets naming the offered ``version`` and its
    ``step`` (> ``after_step``; the weights came on the weight stream, and version 0 is the
    initial checkpoint); one with ``step == after_step`` when nothing newer is due yet;
    ``Shutdown`` when the run has ended and nothing is left to evaluate.
    """

    after_step: int
    report: EvalReport | None = None


# ---------------------------------------------------------------------------------------
# Reward servers: a generator's samples scored by a [[reward_models]] process
# ---------------------------------------------------------------------------------------

ScoreKind = Literal["reward_model", "judge"]
"""What a ``ScoreRequest`` asks for: the discriminative reward model's scores
(``reward_model.enable``) or the LLM judge's verdicts (``reward_model.judge``)."""


class ScoreItem(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True, gc=False):
    """One prompt's responses to score. ``item_id`` names it in the reply; ``prompt_ids``
    and ``responses`` are the policy's token ids (a reward model that reads them),
    ``texts`` the responses decoded (a judge, or a reward model with its own chat
    template); ``responses`` and ``texts`` hold one entry per response, in one order."""

    item_id: str
    messages: list[dict[str, str]]
    prompt_ids: list[int] = []
    responses: list[list[int]] = []
    texts: list[str] = []
    ground_truth: Any = None


class ScoreRequest(Message):
    """A generator asks a reward server (``relay.generators.reward_server``) to score the
    items, all in one batch; ``request_id`` comes back in the ``ScoreReply``."""

    request_id: str
    kind: ScoreKind
    items: list[ScoreItem]


class ScoreResult(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True,
                  gc=False):
    """The scores of one ``ScoreItem`` (``item_id``), one per response in its order, and
    per response why it scored 0 (``errors``: a judge that gave no number; "" where it
    did; empty for a reward model, which raises instead)."""

    item_id: str
    scores: list[float]
    errors: list[str] = []


class ScoreReply(Message):
    """A reward server's answer to ``ScoreRequest`` ``request_id``: one result per item, in
    the request's order."""

    request_id: str
    results: list[ScoreResult]


# ---------------------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------------------


class Metrics(Message):
    """Scalar metrics from any process, for the tracker and the launcher's status line;
    ``phase`` says what the sender is doing while it makes no step ("waiting for the first
    batch"), "" while it steps."""

    source: str
    step: int
    values: dict[str, float]
    phase: str = ""


class Shutdown(Message):
    """Stop cleanly: sent by the buffer to generators when the run ends."""

    reason: str = ""


class Ack(Message):
    """Generic success reply to a request that returns nothing else."""

    detail: str = ""


class ErrorReply(Message):
    """A request was refused: ``code`` says why (a closed set), ``detail`` for people."""

    code: ErrorCode
    detail: str = ""


AnyMessage = Union[
    Attach,
    AttachAck,
    Heartbeat,
    HeartbeatAck,
    Detach,
    LeaseRequest,
    PromptLease,
    LeaseReturn,
    RolloutGroup,
    RolloutAck,
    SampleRequest,
    SampleBatch,
    VersionUpdate,
    BufferCheckpointRequest,
    BufferCheckpoint,
    WeightRequest,
    WeightManifest,
    WeightBucket,
    EvalOffer,
    StreamBeacon,
    EvalRequest,
    ScoreRequest,
    ScoreReply,
    Metrics,
    Shutdown,
    Ack,
    ErrorReply,
]

ALL_MESSAGES: tuple[type[Message], ...] = AnyMessage.__args__  # type: ignore[attr-defined]
