"""Episodes played by a rollout workflow: the user's own async function, or Relay's tool loop.

A workflow is an async function (AReaL's ``RolloutWorkflow.arun_episode``)::

    async def run_episode(engine: EngineHandle, row: EpisodeRow) -> Episode

``rollout.workflow = "my_pkg.agent:run_episode"`` (or ``"path/to/agent.py:run_episode"``)
names one; ``rollout.multi_turn.enable`` runs ``relay.generators.tool_loop.ToolLoop``, which
is one too. ``engine.generate(token_ids)`` samples one turn from the generator's engine:
token ids in, the sampled ids out with their behavior log-probs and weight versions. While
an episode awaits anything else (a tool, a sandbox, a sleep) it holds no engine slot: the
other sequences keep decoding, and its next turn re-enters the batch with the whole
sequence so far (re-prefilled). ``EpisodeBuilder`` keeps the episode's tokens and loss
mask: ``sampled(turn)`` for the policy's tokens (mask 1), ``inserted(ids)`` for tokens the
workflow puts between turns (mask 0: tool responses, the chat template's markers).

The episode is one training sample: ``row.prompt_ids`` (the generator's rendering of the
row's prompt), then ``Episode.response_ids``, at most ``engine.response_length`` tokens.
Its reward is ``Episode.reward``, or, when that is None, the run's reward function on the
decoded response (verl's multi-turn reward: the whole response's text). ``WorkflowRunner``
runs the episodes on an asyncio loop in a thread of its own, beside the generator's compute
loop, which submits their turns to the engine (``relay.generators.process``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import math
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import torch

from relay.algorithms.user_code import describe, load_function
from relay.generators.engine import Completion, Engine, FinishedGroup, GroupRequest
from relay.generators.sampling import SamplingParams
from relay.transport.messages import EpisodeStats


CLOSE_WAIT_S = 5.0  # how long close() waits for cancelled episodes to unwind


class WorkflowError(RuntimeError):
    """A workflow raised, or returned an episode that cannot be a training sample."""


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled turn: the new token ids (the eos token included when it stopped),
    their behavior log-probs and the weight version that sampled each."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"]


class EpisodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """The data row an episode plays (verl's columns) and its rendered prompt."""

    prompt_id: str
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    prompt_ids: list[int]
    sample_index: int  # which of the prompt's n samples this episode is


class Episode(msgspec.Struct, kw_only=True):
    """What a workflow returns: everything after the prompt, with, per token, whether the
    policy sampled it (``loss_mask``), its behavior log-prob (0 where not) and weight
    version. ``reward`` None: the run's reward function scores the decoded response."""

    response_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"] = "stop"
    reward: float | None = None
    reward_info: dict[str, float] = {}
    stats: EpisodeStats = msgspec.field(default_factory=EpisodeStats)


class EpisodeCompletion(Completion, kw_only=True):
    """An episode as the generator's leases and sender carry it: a ``Completion`` (the
    whole response) with its loss mask, statistics and the workflow's reward."""

    loss_mask: torch.Tensor  # (R,) bool
    stats: EpisodeStats
    reward: float | None = None
    reward_info: dict[str, float] = {}


Workflow = Callable[["EngineHandle", EpisodeRow], Awaitable[Episode]]


class EpisodeBuilder:
    """An episode's tokens as a workflow plays it, within ``budget`` response tokens."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.episode = Episode(response_ids=[], loss_mask=[], logprobs=[], versions=[])

    @property
    def remaining(self) -> int:
        """Response tokens left in the budget."""
        return self.budget - len(self.episode.response_ids)

    def sampled(self, turn: Turn) -> None:
        """Append the policy's tokens of ``turn`` (mask 1)."""
        self._append(turn.token_ids, [True] * len(turn.token_ids), turn.logprobs, turn.versions)

    def inserted(self, token_ids: Sequence[int], version: int) -> bool:
        """Append tokens the workflow inserts (mask 0) at weight ``version``; False (and
        the episode cut at the budget, ``finish_reason`` "length") when they do not fit."""
        ids = list(token_ids)[:self.remaining]
        self._append(ids, [False] * len(ids), [0.0] * len(ids), [version] * len(ids))
        if len(ids) < len(token_ids):
            self.episode.finish_reason = "length"
            return False
        return True

    def _append(self, ids: Sequence[int], mask: Sequence[bool], logprobs: Sequence[float],
                versions: Sequence[int]) -> None:
        if len(ids) > self.remaining:
            raise WorkflowError(f"{len(ids)} tokens do not fit the {self.remaining} left of "
                                f"the episode's {self.budget} (rollout.response_length)")
        e = self.episode
        e.response_ids += ids
        e.loss_mask += mask
        e.logprobs += logprobs
        e.versions += versions


@dataclass(eq=False)
class _TurnRequest:
    key: int
    token_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Turn]
    handle: EngineHandle


class EngineHandle:
    """What a workflow sees of the generator's engine (module docstring); one per episode."""

    def __init__(self, runner: WorkflowRunner, params: SamplingParams) -> None:
        self._runner, self.params = runner, params
        self.tokenizer = runner.tokenizer
        self.response_length = runner.response_length
        self.off_engine = False  # a turn came back; the episode has not asked for the next

    @property
    def version(self) -> int:
        """The engine's weight version now (for tokens a workflow inserts)."""
        return self._runner.engine_version()

    async def generate(self, token_ids: Sequence[int], *, max_new_tokens: int | None = None,
                       params: SamplingParams | None = None) -> Turn:
        """Sample one turn after ``token_ids`` with the run's sampling parameters (or
        ``params``), at most ``max_new_tokens`` new tokens (default: the parameters')."""
        params = params or self.params
        if max_new_tokens is not None:
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens {max_new_tokens}: must be at least 1")
            params = msgspec.structs.replace(params, max_new_tokens=max_new_tokens)
        if not token_ids:
            raise ValueError("generate needs at least one token id")
        return await self._runner.request_turn(self, list(token_ids), params)


class WorkflowRunner:
    """Runs a workflow's episodes on an asyncio loop in its own thread; the compute loop
    moves their turns in and out of the engine.

    The compute loop calls ``start(request, row)`` for a group of ``request.n`` episodes,
    ``submit_turns(engine)`` to hand the turns the episodes asked for to the engine,
    ``take_turn(group)`` with each finished engine group (True when it was a turn), and
    ``finished()`` for the groups whose every episode is done (``FinishedGroup`` of
    ``EpisodeCompletion``). ``wait`` blocks until one of those has something.
    """

    def __init__(self, workflow: Workflow, *, tokenizer: Any, response_length: int,
                 engine_version: Callable[[], int], name: str = "workflow") -> None:
        self.workflow, self.name = workflow, name
        self.tokenizer, self.response_length = tokenizer, response_length
        self.engine_version = engine_version
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="episodes",
                                        daemon=True)
        self._thread.start()
        self._requests: queue.SimpleQueue[_TurnRequest] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[object, list[EpisodeCompletion] | BaseException]] \
            = queue.SimpleQueue()
        self._in_engine: dict[int, _TurnRequest] = {}
        self._keys = itertools.count()
        self._wake = threading.Event()
        self.live = 0  # episodes started and not finished (the compute loop's count)
        self._off_engine = 0  # episodes between a turn's result and their next request
        self._count_lock = threading.Lock()
        self._groups: set[concurrent.futures.Future[None]] = set()  # groups in progress

    # -- the compute loop's side ----------------------------------------------------------

    def start(self, request: GroupRequest, row: EpisodeRow) -> None:
        """Play ``request.n`` episodes of ``row``; their group finishes under ``request.key``."""
        self.live += request.n
        group = asyncio.run_coroutine_threadsafe(self._group(request, row), self._loop)
        self._groups.add(group)  # the loop keeps only weak references to its tasks
        group.add_done_callback(self._groups.discard)

    def submit_turns(self, engine: Engine) -> None:
        """Hand every turn asked for since the last call to ``engine``."""
        while True:
            try:
                turn = self._requests.get_nowait()
            except queue.Empty:
                return
            self._in_engine[turn.key] = turn
            engine.submit(GroupRequest(TurnKey(turn.key), turn.token_ids, 1, turn.params))

    @property
    def in_engine(self) -> int:
        """Turns handed to the engine and not yet back."""
        return len(self._in_engine)

    @property
    def off_engine(self) -> int:
        """Episodes that had a turn and have not asked for the next (awaiting a tool, or
        finishing): they hold no engine slot."""
        return self._off_engine

    def take_turn(self, group: FinishedGroup) -> bool:
        """If ``group`` is a turn of an episode, give it to the episode; True then."""
        if not isinstance(group.key, TurnKey):
            return False
        turn = self._in_engine.pop(group.key.index)
        self._set_off_engine(turn.handle, True)
        (completion,) = group.completions
        result = Turn(token_ids=completion.token_ids.tolist(),
                      logprobs=completion.logprobs.tolist(),
                      versions=completion.versions.tolist(),
                      finish_reason="stop" if completion.finish_reason == "stop" else "length")
        self._loop.call_soon_threadsafe(_resolve, turn.future, result)
        return True

    def finished(self) -> list[FinishedGroup]:
        """The groups whose episodes are all done. Raises ``WorkflowError`` for an episode
        that failed (the workflow raised or returned an unusable episode)."""
        self._wake.clear()  # before reading: what arrives from now on sets it again
        if not self._requests.empty():
            self._wake.set()
        out = []
        while True:
            try:
                key, result = self._done.get_nowait()
            except queue.Empty:
                break
            if isinstance(result, BaseException):
                raise WorkflowError(str(result)) from result
            self.live -= len(result)
            out.append(FinishedGroup(key, list(result)))
        return out

    def wait(self, timeout_s: float) -> None:
        """Block until an episode asks for a turn or a group finishes (or ``timeout_s``)."""
        self._wake.wait(timeout_s)

    def close(self) -> None:
        """Cancel the episodes in progress, letting them unwind (their ``finally`` blocks and
        ``async with`` exits release tools), and stop the loop's thread."""
        async def cancel_all() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(
                    CLOSE_WAIT_S + 1.0)
            except TimeoutError:
                pass  # an episode that ignores its cancellation: the daemon thread goes anyway
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_WAIT_S)

    # -- the episodes' side (the loop's thread) ---------------------------------------------

    def _set_off_engine(self, handle: EngineHandle, off: bool) -> None:
        with self._count_lock:
            if handle.off_engine != off:
                handle.off_engine = off
                self._off_engine += 1 if off else -1

    async def request_turn(self, handle: EngineHandle, token_ids: list[int],
                           params: SamplingParams) -> Turn:
        future: asyncio.Future[Turn] = self._loop.create_future()
        self._set_off_engine(handle, False)
        self._requests.put(_TurnRequest(next(self._keys), token_ids, params, future, handle))
        self._wake.set()
        return await future

    async def _group(self, request: GroupRequest, row: EpisodeRow) -> None:
        try:
            rows = [msgspec.structs.replace(row, sample_index=i) for i in range(request.n)]
            episodes = await asyncio.gather(
                *(self._episode(EngineHandle(self, request.params), r) for r in rows))
            self._done.put((request.key, list(episodes)))
        except asyncio.CancelledError:
            raise  # close(): no result to give
        except BaseException as exc:  # noqa: BLE001 - raised in the compute loop
            self._done.put((request.key, exc))
        self._wake.set()

    async def _episode(self, handle: EngineHandle, row: EpisodeRow) -> EpisodeCompletion:
        try:
            episode = await self.workflow(handle, row)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise WorkflowError(f"{self.name} raised on prompt {row.prompt_id}: "
                                f"{describe(exc)}") from exc
        finally:
            self._set_off_engine(handle, False)
        problem = episode_problem(episode, self.response_length)
        if problem:
            raise WorkflowError(f"{self.name} returned an unusable episode for prompt "
                                f"{row.prompt_id}: {problem}")
        return EpisodeCompletion(
            token_ids=torch.tensor(episode.response_ids, dtype=torch.int32),
            logprobs=torch.tensor(episode.logprobs, dtype=torch.float32),
            versions=torch.tensor(episode.versions, dtype=torch.int32),
            finish_reason=episode.finish_reason,
            loss_mask=torch.tensor(episode.loss_mask, dtype=torch.bool),
            stats=episode.stats, reward=episode.reward, reward_info=dict(episode.reward_info))


@dataclass(frozen=True)
class TurnKey:
    """The engine group key of one episode turn (lease groups have tuple keys)."""

    index: int


def _resolve(future: asyncio.Future[Turn], turn: Turn) -> None:
    if not future.done():  # an episode cancelled meanwhile
        future.set_result(turn)


def episode_problem(episode: Any, response_length: int) -> str:
    """Why a workflow's return value cannot be a training sample, or ""."""
    if not isinstance(episode, Episode):
        return f"expected a relay.generators.workflow.Episode, got {type(episode).__name__}"
    n = len(episode.response_ids)
    lengths = {len(episode.loss_mask), len(episode.logprobs), len(episode.versions)}
    if lengths != {n}:
        return (f"{n} response ids but loss_mask, logprobs and versions have "
                f"{len(episode.loss_mask)}, {len(episode.logprobs)} and "
                f"{len(episode.versions)} entries")
    if n > response_length:
        return f"{n} response tokens, more than rollout.response_length = {response_length}"
    if not any(episode.loss_mask):
        return "no token the policy sampled (loss_mask is all false)"
    if any(not m and lp != 0.0 for m, lp in zip(episode.loss_mask, episode.logprobs)):
        return "a log-prob on an inserted token (loss_mask false) must be 0"
    if episode.reward is not None and not math.isfinite(episode.reward):
        return f"reward {episode.reward} is not finite"
    return ""


def load_workflow(spec: str) -> Workflow:
    """The async function ``spec`` names (``module:function`` or ``file.py:function``)."""
    function = load_function(spec, what="rollout.workflow", error=WorkflowError)
    if not inspect.iscoroutinefunction(function) and not inspect.iscoroutinefunction(
            getattr(function, "__call__", None)):
        raise WorkflowError(f"rollout.workflow {spec!r}: {getattr(function, '__name__', function)}"
                            " is not an async function (async def run_episode(engine, row))")
    return function


def play_episodes(runner: WorkflowRunner, engine: Engine,
                  groups: Sequence[tuple[GroupRequest, EpisodeRow]],
                  wait_s: float = 0.5) -> list[list[EpisodeCompletion]]:
    """Play ``groups`` to the end on ``engine`` (nothing else in flight), the episodes of
    each in sample order: held-out evaluation's (and a test's) loop, the generator's
    compute loop without leases."""
    for request, row in groups:
        runner.start(request, row)
    done: dict[object, list[EpisodeCompletion]] = {}
    while len(done) < len(groups):
        for group in runner.finished():
            done[group.key] = group.completions  # type: ignore[assignment]
        runner.submit_turns(engine)
        if engine.in_flight:
            for group in engine.step():
                if not runner.take_turn(group):
                    raise RuntimeError(f"the engine returned group {group.key!r}, not a turn")
        elif len(done) < len(groups):
            runner.wait(wait_s)
    return [done[request.key] for request, _ in groups]
