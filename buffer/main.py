"""The buffer process: ``python -m relay.buffer.main --run-dir RUN_DIR`` (started by the launcher).

Serves the hub (``relay.buffer.hub``) on the topology's buffer address, expires leases on a
timer, pushes its gauges to the launcher's status line, and exits once the learner has
ended the run and the generators have been told (or after a grace period). On SIGTERM or
SIGINT (the launcher stops every run this way: Ctrl-C, the learner done, the watchdog, an
essential process that died) it answers each attached generator's next request with
``Shutdown`` and the reason, for up to two heartbeat intervals (``DRAIN_S``), so that a
generator attached by hand leaves within seconds instead of retrying a vanished buffer for
``buffer.client_patience_s``. When a replay filter cannot go on (``Hub.failure``) it tells
the generators the same way and exits 1, naming the cause: the launcher then ends the run
as failed. The hub checks rollout groups against the run's limits
(``relay.buffer.validation``): the model's vocabulary (``buffer.vocab_size``, or ``model.path``'s
``config.json``), ``rollout.response_length``, ``rollout.n``; the socket refuses frames over
``buffer.max_message_bytes`` and hands the hub each request's sender, whose role it checks.
Memory: the socket queues at most ``REQUEST_HWM`` requests per connection, decoded by
``request_decoder`` (the hub's requests only, at most one group's tensors, none in an
``Any`` field), so that what peers' frames hold in the buffer is about ``(REQUEST_HWM + 2)
x buffer.max_message_bytes`` per connection for requests of one body frame (ZeroMQ bounds
frames and queued messages, not the frames of one message: see ``relay.transport.sockets``).

Resuming (``trainer.resume_mode = "resume_path"``, which the launcher resolves ``auto`` and
``--resume`` into): the buffer restarts from the state the learner saved in the checkpoint
(``relay.buffer.prompt_source.BUFFER_CHECKPOINT_FILE``, asked of the buffer when the checkpoint
was written, after its step). The prompt stream continues from the saved loader position,
and every prompt that had not been trained on by then (leased, in the return pool, or
answered by a group still waiting in the store) is leased again first, in the order it was
first leased. Groups that were stored or in flight when the run died are discarded: their
tokens may come from weights newer than the checkpoint. The lease gate starts from the
groups trained on (``BufferCheckpoint.accepted``) and the learner's version arrives, as
always, by ``VersionUpdate`` (the learner publishes the checkpoint's weights when it
resumes). The replay store starts empty: replay priorities, reuse counts and the replay
filters' counters (DAPO's generation cap, PF-PPO's draws) start afresh.

The checkpoint also holds the config it was written under (``relay.buffer.fingerprint``). The
launcher refuses a resume that changes it unless the user allowed the change by name; an
allowed change is logged here and handled so that the run goes on: other training rows, seed
or shuffle start their rows afresh at the next epoch, after the prompts not trained on; another
``data.train_batch_size`` rebases the gate's count (``resumed_accepted``). A gate that can
still never open (a checkpoint too old to say its batch size) ends the run with the reason at
the learner's first request (``Hub.failure``), and a saved stream the rows cannot continue is
a ``PromptStreamError`` naming the keys, before the buffer serves anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import msgspec
import torch

from relay.buffer.dynamic_sampling import DynamicSampling
from relay.buffer.fingerprint import BATCH_KEY, STREAM_KEYS, buffer_fingerprint, changes
from relay.buffer.hub import SENDERS, Hub
from relay.buffer.pf_ppo import PolicyFiltration
from relay.buffer.prioritized import PrioritizedStore
from relay.buffer.prompt_source import PromptSource, read_buffer_checkpoint
from relay.buffer.rollout_dump import rollout_dump
from relay.buffer.rollout_log import RolloutLogWriter
from relay.buffer.store import FifoStore, FilteredStore, GroupFilter, ReplayStore
from relay.buffer.validation import GroupLimits
from relay.configs.prompt_data import (
    PromptDataset,
    chat_token_counter,
    fit_prompts,
    load_prompt_rows,
)
from relay.configs.run_schema import RunConfig
from relay.configs.rundir import RunContext, configure_logging, load_run_dir
from relay.transport.codec import Decoder
from relay.transport.messages import HEARTBEAT_EVERY_S, BufferCheckpoint, Metrics, Sample
from relay.transport.sockets import Pusher, Server

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("relay.buffer")

TICK_S = 0.25
# a turn of the serving loop this much longer than TICK_S means the buffer was not running;
# the clients, whose messages wait in the queue, get that time back (``Hub.excuse``)
STALL_S = 5.0
METRICS_EVERY_S = 1.0
SHUTDOWN_GRACE_S = 10.0  # after the learner ends the run, wait this long for generators
# after a stop signal or a failure: every live generator heartbeats within this time, so
# hears that the run is over (``Shutdown``) instead of retrying a vanished buffer
DRAIN_S = 2 * HEARTBEAT_EVERY_S
STOP_REASON = "the buffer got a stop signal (the launcher ends the run, or an operator)"
# once every generator has been told: a request a generator sent meanwhile (a lease, a
# group) still gets its answer, and the last replies leave the socket (closed without linger)
LINGER_S = HEARTBEAT_EVERY_S / 2
REQUEST_HWM = 16
"""Requests ZeroMQ queues per connection while the buffer is busy (its receive high-water
mark; a client has one request in flight), and replies it queues to a peer that does not
read them: a connection holds at most REQUEST_HWM + 1 requests (the one being read) in the
buffer's memory, each of frames up to ``buffer.max_message_bytes``; the default, 1000,
let one peer park a message per 64 MiB up to 64 GiB."""
TENSORS_PER_SAMPLE = sum(f.type in (torch.Tensor, torch.Tensor | None)
                         for f in msgspec.structs.fields(Sample))
"""Tensor fields of a ``Sample`` (the optional ``loss_mask`` included): a sound group holds
at most ``rollout.n`` times as many tensors."""


def build_store(run: RunConfig) -> ReplayStore:
    """The FIFO or prioritized store, behind the replay filters the run config turns on."""
    replay = run.buffer.replay
    inner: ReplayStore = FifoStore()
    if replay.priority != "fifo":
        inner = PrioritizedStore(replay, max_staleness=run.buffer.max_staleness)
    filters: list[GroupFilter] = []
    dynamic, pf_ppo = run.buffer.filter_groups, run.buffer.pf_ppo
    if dynamic.enable:
        filters.append(DynamicSampling(dynamic.metric, run.data.train_batch_size,
                                       dynamic.max_num_gen_batches))
    if pf_ppo.enable:
        filters.append(PolicyFiltration(pf_ppo.mode, pf_ppo.seed))
    return FilteredStore(inner, filters) if filters else inner


def build_hub(ctx: RunContext) -> Hub:
    run = ctx.run
    dataset = training_prompts(run)
    source = PromptSource(dataset, shuffle=run.data.shuffle, seed=run.data.seed)
    log = RolloutLogWriter(ctx.run_dir / "rollouts") if run.buffer.rollout_log else None
    logger.info("%d training prompts; serving %d groups of %d per step, max staleness %d",
                len(dataset), run.data.train_batch_size, run.rollout.n,
                run.buffer.max_staleness)
    limits = GroupLimits(n=run.rollout.n, vocab_size=vocab_size(run),
                         response_length=run.rollout.response_length,
                         greedy_baseline=run.algorithm.estimator.greedy_baseline)
    hub = Hub(run.buffer, source, build_store(run), log, batch_size=run.data.train_batch_size,
              limits=limits, prompts_per_lease=run.rollout.prompts_per_lease,
              total_steps=run.trainer.total_training_steps,
              steps_per_version=run.trainer.publish_every, dump=rollout_dump(run))
    hub.fingerprint = buffer_fingerprint(run, dataset)
    if ctx.resume_from is not None:
        resume(hub, ctx.resume_from)
    return hub


def training_prompts(run: RunConfig,
                     tokenizer: PreTrainedTokenizerBase | None = None) -> PromptDataset:
    """The training rows (``data.prompt_key``), without the prompts longer than
    ``data.max_prompt_length`` when ``data.filter_overlong_prompts`` (counted and logged), or
    refusing them when ``data.truncation = "error"``; lengths count the chat template's
    tokens with ``tokenizer``, by default ``model.path``'s, loaded only for these two
    settings. The launcher counts an epoch with it too (``relay.launcher.resolve.epoch_rows``)."""
    data = run.data
    rows = load_prompt_rows(data.train_files, prompt_key=data.prompt_key)
    if data.filter_overlong_prompts or data.truncation == "error":
        if tokenizer is None:
            from transformers import AutoTokenizer  # only here: the buffer needs no other part

            tokenizer = AutoTokenizer.from_pretrained(
                run.model.path, trust_remote_code=run.model.trust_remote_code)
        rows = fit_prompts(rows, chat_token_counter(tokenizer), data.max_prompt_length,
                           drop=data.filter_overlong_prompts,
                           refuse=data.truncation == "error", what="data.train_files").rows
    return PromptDataset(rows)


def vocab_size(run: RunConfig) -> int:
    """``buffer.vocab_size``, or the ``vocab_size`` in ``model.path``'s ``config.json`` (at
    its top level, or in its ``text_config`` for multimodal models)."""
    if run.buffer.vocab_size:
        return run.buffer.vocab_size
    path = Path(run.model.path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"buffer: cannot read the model's vocabulary size from {path} ({exc}); "
                         "set buffer.vocab_size when the buffer's host has no copy of the "
                         "model") from exc
    text_config = config.get("text_config") if isinstance(config, dict) else None
    size = next((c["vocab_size"] for c in (config, text_config)
                 if isinstance(c, dict) and "vocab_size" in c), None)
    if not isinstance(size, int) or size <= 0:
        raise SystemExit(f"buffer: {path} names no vocab_size; set buffer.vocab_size")
    return size


def resume(hub: Hub, checkpoint: Path) -> None:
    """Continue the prompt stream saved in ``checkpoint`` under ``hub.fingerprint``, the
    config now (module docstring)."""
    saved = read_buffer_checkpoint(checkpoint)
    changed = changes(saved.fingerprint, hub.fingerprint)
    for change in changed:
        logger.warning("resuming under a changed config (allowed at launch): %s", change)
    same_rows = not any(change.key in STREAM_KEYS for change in changed)
    hub.source.restore(saved.source, same_rows=same_rows)
    hub.accepted = resumed_accepted(saved, hub.batch_size)
    logger.info("resuming from %s (after step %d): %d prompts not trained on by then are "
                "leased again first, epoch %d", checkpoint, saved.step,
                len(saved.source.pending), saved.source.epoch)


def resumed_accepted(saved: BufferCheckpoint, batch_size: int) -> int:
    """The lease gate's count of groups trained, under ``batch_size``. The checkpoint after
    step S counted A groups at its batch size B; the gate compares that count with steps x
    batch size, so under B' it starts from

        max(0, A + S * (B' - B))

    (A - S * B, at most 0, is what replay reuse saved), as if every step had had B' groups."""
    before = saved.fingerprint.get(BATCH_KEY)
    if not isinstance(before, int) or before == batch_size:
        return saved.accepted
    return max(0, saved.accepted + saved.step * (batch_size - before))


def request_decoder(run: RunConfig) -> Decoder[Any]:
    """The buffer's decoder: only the requests the hub takes (``relay.buffer.hub.SENDERS``; any
    other message is a ``schema`` error), tensors only in their tensor fields (one in an
    ``Any`` field, such as a group's ``metadata``, is a ``tensor`` error and never built) and
    at most those of one sound group, ``TENSORS_PER_SAMPLE`` x ``rollout.n``: what a message
    can make the buffer allocate is then bounded by its bytes, not by how many tensors a
    few bytes can name (1M one-byte tensors in 15 MB took 526 MiB and 4 s to decode)."""
    requests = Union[tuple(SENDERS)]  # type: ignore[valid-type]
    return Decoder(requests, max_tensors=TENSORS_PER_SAMPLE * run.rollout.n,
                   tensors_in_any=False)


def serve(ctx: RunContext, hub: Hub, stop: threading.Event) -> None:
    """Serve until the run is over and every attached generator has been told so (and
    ``LINGER_S`` more), for at most ``SHUTDOWN_GRACE_S`` once the learner ended the run, or
    ``DRAIN_S`` once ``stop`` is set (``Hub.stop``) or the hub failed (``Hub.failure``)."""
    server = Server(ctx.buffer_endpoint, hub.handle, decoder=request_decoder(ctx.run),
                    keys=ctx.server_keys(), hwm=REQUEST_HWM,
                    max_message_bytes=ctx.run.buffer.max_message_bytes)
    metrics = Pusher(ctx.metrics_endpoint, keys=ctx.client_keys())
    logger.info("buffer serving on %s", server.endpoint)
    next_tick = next_metrics = time.monotonic()
    finished_at: float | None = None
    told_all_at: float | None = None  # every generator has been told that the run is over
    try:
        while True:
            began = time.monotonic()
            server.serve_once(TICK_S)
            now = time.monotonic()
            if now - began > STALL_S:  # this process did not run (SIGSTOP, swap, a long GC)
                hub.excuse(now - began)
            if now >= next_tick:
                hub.tick()
                next_tick = now + TICK_S
            if now >= next_metrics:
                metrics.send(Metrics(source="buffer", step=0, values=hub.stats()))
                next_metrics = now + METRICS_EVERY_S
            if stop.is_set():
                hub.stop(STOP_REASON)
            if hub.finished:
                finished_at = finished_at or now
                told_all_at = (told_all_at or now) if hub.generators == 0 else None
                grace = DRAIN_S if stop.is_set() or hub.failure else SHUTDOWN_GRACE_S
                all_told = told_all_at is not None and now - told_all_at > LINGER_S
                if all_told or now - finished_at > grace:
                    break
    finally:
        if server.errors:
            logger.warning("rejected requests by kind: %s", dict(server.errors))
        server.close()
        metrics.close(linger_s=0.5)
        if hub.log is not None:
            hub.log.close()
    logger.info("buffer done: %s", {k: v for k, v in hub.stats().items() if v})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay.buffer.main")
    parser.add_argument("--run-dir", required=True, help="run directory written by the launcher")
    args = parser.parse_args(argv)
    configure_logging()
    ctx = load_run_dir(args.run_dir)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    hub = build_hub(ctx)
    serve(ctx, hub, stop)
    if hub.failure:
        logger.error("run failed: %s", hub.failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
