"""Checkpoints: written atomically every ``trainer.save_freq`` steps, read back to resume.

A checkpoint is a folder ``step-<N>`` under the checkpoint dir holding everything a run
needs to go on after step N:

- ``dcp/``: the sharded state of every trained model and its optimizer
  (``torch.distributed.checkpoint``), written by every rank in parallel, loadable at any
  world size: the policy under ``model`` and ``optim``, and, where the algorithm has them,
  the critic (PPO) under ``critic`` and the implicit PRM (PRIME) under ``prm``;
- ``hf/``: the policy (in float32) and its tokenizer in Hugging Face format, written by
  rank 0 one shard at a time (``relay.learner.hf_export``), so the trained model loads with
  ``AutoModelForCausalLM.from_pretrained`` like any other;
- ``adapter/``, a LoRA policy's only (``model.lora_rank`` > 0): its adapters in peft's format
  (``adapter_model.safetensors``, ``adapter_config.json``; ``relay.learner.lora.save_adapter``),
  which ``PeftModel.from_pretrained`` loads onto the base model; ``dcp/`` then holds the
  adapters and their optimizer state alone (the frozen base is ``model.path``'s, read
  again on a resume) and ``hf/`` the merged weights W + (alpha / r) B A;
- ``critic_adapter/``, a LoRA critic's only (``critic.model.lora_rank`` > 0): its body's
  adapters in peft's format and its value head (``relay.learner.lora.save_critic_adapter``);
  ``dcp/`` holds the whole critic, frozen base included;
- ``rng/rank-<r>.json``: each rank's random states (torch's CPU generator, the CUDA one on a
  GPU, Python's ``random``);
- ``buffer.rec``: the buffer's prompt stream after step N, asked of the buffer while the
  checkpoint is written (``relay.buffer.prompt_source``; the buffer restarts from it);
- ``meta.json``, written last (``CheckpointMeta``): the train loop's step, weight version
  and whether the policy changed since that version was published; the learner's step
  count; the learning-rate schedules; the KL controller's coefficient; the world size; the
  trained parts; the MLflow run; the lineage; when it was written; the size and SHA-256 of
  every other file (``relay.learner.checkpoint_meta``).

Atomicity. Everything is written into ``step-<N>.tmp`` (claimed for the run's lineage:
``relay.learner.checkpoint_lineage``); once every rank's files are in place the ranks hash them,
rank 0 fsyncs them, writes ``meta.json`` (to a temporary name, fsync, ``os.replace``),
clears the group and other write bits of everything, renames the folder to ``step-<N>``
(then fsyncs the checkpoint dir) and prunes the lineage's old checkpoints and leftovers.
What makes a folder a complete checkpoint, and finding them: ``relay.learner.checkpoint_meta``.

Verifying. ``check_resumable`` (the launcher's check of the checkpoint a run resumes from)
refuses a checkpoint that is not intact (``relay.learner.checkpoint_meta.check_intact``: not this
user's, writable by the group or others, a file whose size or SHA-256 differs from the
manifest, DCP metadata that asks to run code), naming the folder or file;
``resumable_checkpoint`` (``trainer.resume_mode = "auto"``) takes the most recently written
checkpoint that passes, saying which newer ones it skipped and why.

Resuming (``load_checkpoint``) puts every piece back; ``dcp`` reshards, so the world size
may differ (rank r takes the random state of saved rank r mod the saved world size). The
optimizers' learning rates, betas and weight decays are the run config's, not the
checkpoint's (``relay.learner.optim.reapply_configured``: each that differs is logged), so an
edited ``run.toml`` takes effect on a resume or a replay; the schedules keep their step. A
checkpoint whose trained parts differ from the run's (a critic, but the run is GRPO) or
whose tensors do not fit the run's models is refused with a ``CheckpointError`` naming it
(the damaged file first, when the manifest shows one). The sharded state is read without
running any pickle it holds (``relay.learner.safe_dcp``).

Several hosts. Every rank writes its own shards into the checkpoint folder and rank 0
commits it, so a learner on several hosts needs that folder on a filesystem they all see;
``check_shared_checkpoints`` proves it at start, before any model is loaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from transformers import AutoModelForCausalLM

from relay.buffer.durable import fsync_tree
from relay.buffer.prompt_source import (
    BufferCheckpointError,
    read_buffer_checkpoint,
    write_buffer_checkpoint,
)
from relay.configs.run_schema import RunConfig
from relay.learner import safe_dcp
from relay.learner.checkpoint_files import (
    CheckpointError,
    FileDigest,
    listed_files,
    manifest,
    replace_folder,
    tighten_modes,
    write_durably,
)
from relay.learner.checkpoint_lineage import WRITER_FILE, Lineage, claim, claim_name, prune
from relay.learner.checkpoint_meta import (
    FORMAT,
    META_FILE,
    PARTIAL_SUFFIX,
    CheckpointMeta,
    LoopState,
    check_intact,
    newest_first,
    read_meta,
    verify_files,
)
from relay.learner.update import Learner
from relay.learner.hf_export import save_hf, write_state
from relay.learner.optim import ConfiguredValues, configured_values, reapply_configured
from relay.transport.messages import BufferCheckpoint, BufferCheckpointRequest
from relay.transport.retry import patient_request
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client

logger = logging.getLogger(__name__)

OPTIM_KEYS = {"policy": "actor.optim", "critic": "critic.optim",
              "prm": "reward_model.model.optim"}  # each trained part's optimizer config
BUFFER_REQUEST_TIMEOUT_S = 60.0
ADAPTER_FOLDER = "adapter"  # a LoRA policy's adapters, in peft's format
CRITIC_ADAPTER_FOLDER = "critic_adapter"  # a LoRA critic's adapters (peft's) and value head


# -- what a learner trains ------------------------------------------------------------------


def trained_parts(learner: Learner) -> list[str]:
    """The learner's trained models: the policy, and the critic or the PRM if it has one."""
    return ["policy"] + [name for name, part in (("critic", learner.critic),
                                                 ("prm", learner.prm)) if part is not None]


def expected_parts(run: RunConfig) -> list[str]:
    """The trained models of a learner built for ``run`` (``relay.learner.main.build_learner``)."""
    return ["policy", *run.algorithm.estimator.learned_models]


def checkpoint_state(learner: Learner) -> dict[str, dict]:
    """The sharded state dicts a checkpoint holds, by name (see the module docstring); of
    a LoRA policy, its adapters only (``_policy_options``); of a policy in a DeepSpeed
    engine, its full state in the same layout (``ZeroEngine.full_state``)."""
    if learner.zero is not None:
        model_state, optim_state = learner.zero.full_state()
    else:
        model_state, optim_state = get_state_dict(learner.model, learner.optimizer,
                                                  options=_policy_options(learner))
    state: dict[str, dict] = {"model": model_state, "optim": optim_state}
    for name, part in (("critic", learner.critic), ("prm", learner.prm)):
        if part is not None:
            part_model, part_optim = get_state_dict(part.model, part.optimizer)
            state[name] = {"model": part_model, "optim": part_optim}
    return state


def _policy_options(learner: Learner) -> StateDictOptions:
    """How the policy's state is read and put back: without its frozen parameters, which
    only a LoRA policy has (its base weights, read again from ``model.path`` on a resume),
    so that a LoRA checkpoint holds the adapters and their optimizer state alone."""
    return StateDictOptions(ignore_frozen_params=True,
                            strict=all(p.requires_grad for p in learner.model.parameters()))


def save_policy_hf(learner: Learner, folder: Path, rank: int,
                   group: dist.ProcessGroup | None, state: dict[str, dict]) -> None:
    """The policy in fp32 as a Hugging Face folder (``hf/``; every rank calls it). Under
    DeepSpeed with bf16 the module's weights are the masters rounded to bf16, so the
    engine's fp32 masters are written instead, as FSDP2's fp32 shards are: the full state
    the checkpoint already read (``state``, ``checkpoint_state``'s)."""
    zero = learner.zero
    if zero is None or not zero.low_precision:
        with learner.full_policy():
            save_hf(learner.model, folder, torch.float32, group=group)
    elif rank == 0:
        write_state(state["model"], learner.model.config, AutoModelForCausalLM, folder,
                    torch.float32)


def _schedulers(learner: Learner) -> dict[str, torch.optim.lr_scheduler.LRScheduler]:
    schedulers = {"policy": learner.scheduler}
    for name, part in (("critic", learner.critic), ("prm", learner.prm)):
        if part is not None:
            schedulers[name] = part.scheduler
    return schedulers


def _optimizers(learner: Learner) -> dict[str, torch.optim.Optimizer]:
    optimizers = {"policy": learner.optimizer}
    for name, part in (("critic", learner.critic), ("prm", learner.prm)):
        if part is not None:
            optimizers[name] = part.optimizer
    return optimizers


# -- saving ---------------------------------------------------------------------------------


def save_checkpoint(learner: Learner, folder: Path, loop: LoopState, *, lineage: Lineage,
                    keep_last: int, tokenizer=None, buffer: BufferCheckpoint | None = None,
                    mlflow_run_id: str = "", group: dist.ProcessGroup | None = None) -> Path:
    """Write ``folder/step-<loop.step>`` atomically (a collective: call on every rank) and
    prune ``lineage``'s old checkpoints (the run's, ``run_lineage``: the same on every
    rank). Rank 0 passes the tokenizer, the buffer's state and the MLflow run id; a
    checkpoint without the buffer's state cannot be resumed by the launcher. ``group``: a
    CPU (gloo) group of every rank, for the Hugging Face export and the checksums on GPUs.
    A ``CheckpointError`` on rank 0 when ``step-<N>`` holds another lineage's checkpoint."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = folder / f"step-{loop.step}"
    partial = folder / f"step-{loop.step}{PARTIAL_SUFFIX}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        claim(final, lineage)
    _barrier()
    state = checkpoint_state(learner)
    dcp.save(state, checkpoint_id=str(partial / "dcp"))
    _write_rng(partial / "rng", rank)
    save_policy_hf(learner, partial / "hf", rank, group, state)
    del state
    if getattr(learner.model, "peft_config", None) is not None:
        from relay.learner.lora import save_adapter  # peft: the lora extra
        save_adapter(learner.model, partial / ADAPTER_FOLDER, group=group)
    if learner.critic is not None and getattr(learner.critic.model.body, "peft_config",
                                              None) is not None:
        from relay.learner.lora import save_critic_adapter  # peft: the lora extra
        save_critic_adapter(learner.critic.model.body, learner.critic.model.value_head,
                            partial / CRITIC_ADAPTER_FOLDER, group=group)
    if rank == 0:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(partial / "hf"))
        if buffer is not None:
            write_buffer_checkpoint(partial, buffer)
    _barrier()  # every rank's files are in place
    files = _manifest(partial, group)
    if rank == 0:
        meta = CheckpointMeta(format=FORMAT, loop=loop, steps_done=learner.steps_done,
                              world_size=dist.get_world_size() if dist.is_initialized() else 1,
                              parts=trained_parts(learner),
                              schedulers={name: scheduler.state_dict() for name, scheduler
                                          in _schedulers(learner).items()},
                              kl_coef=learner.kl_ctrl.value if learner.kl_ctrl else None,
                              mlflow_run_id=mlflow_run_id, lineage=lineage,
                              saved_at=time.time(), files=files)
        (partial / WRITER_FILE).unlink()
        fsync_tree(partial)
        write_durably(partial / META_FILE, msgspec.json.encode(meta))
        tighten_modes(partial)  # meta.json too: the umask may leave group write on it
        claim_name(final, lineage)  # another run may have taken it meanwhile
        replace_folder(partial, final)
        prune(folder, final, lineage, keep_last)
        logger.info("checkpoint saved to %s", final)
    _barrier()
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_rng(folder: Path, rank: int) -> None:
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()),
                             "python": list(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    folder.mkdir(parents=True, exist_ok=True)
    write_durably(folder / f"rank-{rank}.json", json.dumps(state).encode())


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _manifest(partial: Path, group: dist.ProcessGroup | None) -> dict[str, FileDigest]:
    """The size and SHA-256 of every file in ``partial`` but ``writer.json`` (a collective:
    rank 0 lists them and shares them out by size, largest first to the least loaded rank;
    each rank hashes its share); the whole manifest on rank 0, {} on the others."""
    if not dist.is_initialized():
        return manifest(partial, listed_files(partial, [WRITER_FILE]))
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[list[list[str]] | None] = [None]
    if rank == 0:
        sizes = {name: (partial / name).stat().st_size
                 for name in listed_files(partial, [WRITER_FILE])}
        shares[0] = _share_out(sizes, world)
    dist.broadcast_object_list(shares, src=0, group=group)
    assert shares[0] is not None
    mine = manifest(partial, shares[0][rank])
    gathered: list[dict[str, FileDigest]] | None = [{} for _ in range(world)] \
        if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    return {name: digest for part in gathered or [] for name, digest in part.items()}


def _share_out(sizes: dict[str, int], ranks: int) -> list[list[str]]:
    """``sizes``' files in ``ranks`` shares of about equal bytes (largest first, each to the
    share with the fewest bytes so far)."""
    shares: list[list[str]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        shares[least].append(name)
        loads[least] += sizes[name]
    return shares


# -- what a run can resume from -------------------------------------------------------------


def resumable_checkpoint(folder: Path, run: RunConfig) -> Path | None:
    """The newest checkpoint in ``folder`` that ``run`` can resume from (``check_resumable``;
    None if none), with a warning for each newer one skipped saying why."""
    skipped: list[Path] = []
    for path, _meta in newest_first(folder):
        try:
            check_resumable(path, run)
        except (CheckpointError, BufferCheckpointError) as exc:
            logger.warning("skipping %s: %s", path, exc)
            skipped.append(path)
            continue
        if skipped:
            logger.warning("resuming from %s, the newest valid checkpoint: the newer %s cannot "
                           "be resumed (above: why)", path, ", ".join(p.name for p in skipped))
        return path
    return None


def check_resumable(checkpoint: Path, run: RunConfig) -> CheckpointMeta:
    """``checkpoint``'s meta, after checking that ``run`` can resume from it: complete, the
    same trained parts, intact (``check_intact``: this user's and not writable by the group
    or others, every file as its manifest recorded, DCP metadata that runs no code), the
    buffer's state present. ``CheckpointError`` (or ``BufferCheckpointError``) naming the
    folder or file otherwise."""
    meta = read_meta(checkpoint)
    check_parts(meta, expected_parts(run), checkpoint)
    check_intact(checkpoint, meta)
    read_buffer_checkpoint(checkpoint)  # raises BufferCheckpointError naming the file
    return meta


def check_parts(meta: CheckpointMeta, parts: list[str], checkpoint: Path) -> None:
    if meta.parts != parts:
        raise CheckpointError(f"{checkpoint}: holds {', '.join(meta.parts)} but this run "
                              f"trains {', '.join(parts)} (algorithm.adv_estimator decides "
                              "the critic and the PRM); resume with the algorithm it was "
                              "written with")


# -- a filesystem every learner host sees ---------------------------------------------------


def check_shared_checkpoints(folder: Path, resume_from: Path | None, *, hosts: int,
                             saves: bool, group: dist.ProcessGroup | None = None) -> None:
    """A learner on several ``hosts`` writes one checkpoint from every rank into ``folder``
    (when it ``saves``) and reads back the one it resumes from: check, before any model is
    loaded, that every rank sees both as rank 0 does. Rank 0 writes a nonce file into
    ``folder`` that every rank must read (``_shared_probe``); every rank reads the
    ``meta.json`` of ``resume_from``. A collective (call on every rank; ``group``: a CPU
    group of every rank, None for the default one); each rank raises the same
    ``CheckpointError`` naming the folder and the ranks that saw otherwise. One host:
    nothing to check."""
    if hosts < 2:
        return
    if saves or resume_from is not None:
        _shared_probe(folder, group)
    if resume_from is not None:
        readings = _readings(resume_from / META_FILE, group)
        if _differing(readings):
            raise CheckpointError(f"{resume_from}: the checkpoint to resume from reads "
                                  f"differently, or not at all, on "
                                  f"{', '.join(_differing(readings))} than on rank 0 (on "
                                  f"{readings[0][0]}): it must be on a filesystem every "
                                  "learner host sees, at the same path")


SHARED_PROBE_PREFIX = ".shared-probe-"


def _shared_probe(folder: Path, group: dist.ProcessGroup | None) -> None:
    """Rank 0 writes a fresh nonce into ``folder``; after it, every rank reads it."""
    nonce = [secrets.token_hex(16) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(nonce, src=0, group=group)
    probe = folder / f"{SHARED_PROBE_PREFIX}{nonce[0]}"
    if dist.get_rank() == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_durably(probe, nonce[0].encode())
        except OSError as exc:  # every rank must still reach the collectives below
            logger.error("cannot write %s: %s", probe, exc)
    dist.barrier(group=group)
    readings = _readings(probe, group)  # every rank has read it once this returns
    if readings[0][1] is None:
        raise CheckpointError(f"{folder}: rank 0 (on {readings[0][0]}) cannot write into the "
                              "checkpoint folder (its log says why)")
    if dist.get_rank() == 0:
        probe.unlink()
    if _differing(readings):
        raise CheckpointError(f"{folder}: {', '.join(_differing(readings))} cannot read the "
                              f"file rank 0 (on {readings[0][0]}) wrote into this checkpoint "
                              "folder. Every rank writes its shards of a checkpoint there, so "
                              "it must be on a filesystem every learner host sees at the same "
                              "path: set checkpoint.dir (or trainer.run_dir) to one")


def _readings(path: Path, group: dist.ProcessGroup | None) -> list[tuple[str, str | None]]:
    """Every rank's host and the SHA-256 of the bytes it reads at ``path`` (None: it cannot
    read it), in rank order, on every rank."""
    try:
        digest: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        digest = None
    readings: list[tuple[str, str | None]] = [("", None)] * dist.get_world_size(group)
    dist.all_gather_object(readings, (socket.gethostname(), digest), group=group)
    return readings


def _differing(readings: list[tuple[str, str | None]]) -> list[str]:
    """The ranks (``rank r on HOST``) that read nothing or other bytes than rank 0."""
    reference = readings[0][1]
    return [f"rank {rank} on {host}" for rank, (host, digest) in enumerate(readings)
            if digest is None or digest != reference]


# -- loading --------------------------------------------------------------------------------


def load_checkpoint(learner: Learner, checkpoint: Path) -> CheckpointMeta:
    """Put every piece of ``checkpoint`` back into ``learner`` and this process (a
    collective: call on every rank); returns its meta for the loop's own state. Its files
    are verified against the manifest (``check_resumable``, by the launcher and the replay)
    before, and here again when they fail to load, to blame a damaged file first."""
    meta = read_meta(checkpoint)
    check_parts(meta, trained_parts(learner), checkpoint)
    optimizers, schedulers = _optimizers(learner), _schedulers(learner)
    configured = {name: configured_values(optimizers[name], schedulers[name])
                  for name in schedulers}
    state = checkpoint_state(learner)
    try:
        safe_dcp.load(state, str(checkpoint / "dcp"))
    except (CheckpointException, CheckpointError) as exc:
        verify_files(checkpoint, meta)  # a damaged file is to blame first: name it
        if isinstance(exc, CheckpointError):
            raise
        causes = "; ".join(f"rank {rank}: {error}" for rank, (error, _trace)
                           in sorted(exc.failures.items()))
        raise CheckpointError(f"{checkpoint}: its weights do not fit this run's models "
                              f"(model.path and the algorithm must be those it was written "
                              f"with): {causes}") from exc
    if learner.zero is not None:
        learner.zero.load_full_state(state["model"], state["optim"])
    else:
        set_state_dict(learner.model, learner.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_policy_options(learner))
    for name, part in (("critic", learner.critic), ("prm", learner.prm)):
        if part is not None:
            set_state_dict(part.model, part.optimizer, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(meta.schedulers[name])
    _reapply_configured(optimizers, schedulers, configured, checkpoint)
    if learner.kl_ctrl is not None and meta.kl_coef is not None:
        learner.kl_ctrl.value = meta.kl_coef
    elif learner.kl_ctrl is not None:
        logger.warning("%s: written without KL in the reward; the KL controller starts at "
                       "its initial coefficient", checkpoint)
    learner.steps_done = meta.steps_done
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    _read_rng(checkpoint / "rng" / f"rank-{rank % meta.world_size}.json")
    if world != meta.world_size and rank == 0:
        logger.info("%s was written by %d ranks, resumed by %d (resharded)", checkpoint,
                    meta.world_size, world)
    return meta


def _reapply_configured(optimizers: dict[str, torch.optim.Optimizer],
                        schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler],
                        configured: dict[str, ConfiguredValues], checkpoint: Path) -> None:
    """The config's learning rates, betas and weight decays over the checkpoint's
    (``relay.learner.optim.reapply_configured``); rank 0 logs each that differs."""
    for name, scheduler in schedulers.items():
        changes = reapply_configured(optimizers[name], scheduler, configured[name],
                                     OPTIM_KEYS[name])
        if not dist.is_initialized() or dist.get_rank() == 0:
            for change in changes:
                logger.info("%s: %s", checkpoint, change)


def _read_rng(path: Path) -> None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable random state: {exc}") from exc
    torch.set_rng_state(_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(state["cuda"]))


def _tensor(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)


# -- the buffer's part ----------------------------------------------------------------------


class BufferStateLink:
    """Rank 0's request for the buffer's state when it writes a checkpoint, on a connection
    of its own beside ``relay.learner.buffer_link.BufferLink``, retried through a buffer
    stall for up to ``patience_s`` (``buffer.client_patience_s``) like that link's
    requests."""

    def __init__(self, endpoint: str, patience_s: float, keys: ClientKeys | None = None) -> None:
        self._client = Client(endpoint, keys=keys)
        self.patience_s = patience_s

    def state(self, step: int) -> BufferCheckpoint:
        reply = patient_request(self._client, BufferCheckpointRequest(step=step),
                                BUFFER_REQUEST_TIMEOUT_S, self.patience_s,
                                expect=BufferCheckpoint)
        assert isinstance(reply, BufferCheckpoint)
        return reply

    def close(self) -> None:
        self._client.close()
