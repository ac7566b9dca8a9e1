"""The learner: ``torchrun ... -m relay.learner.main --run-dir RUN_DIR`` (started by the launcher).

Parse, build, run, close: the process group (gloo on CPU; on a GPU NCCL for CUDA tensors
and gloo for CPU ones), the FSDP2 policy and optional reference, the optimizer and
schedule; rank 0 also builds its link to the buffer, the weight server and the MLflow
run. A resumed run (``trainer.resume_mode``, resolved by the launcher) then loads its
checkpoint (``relay.learner.checkpoint``) into all of them and continues the MLflow run it names.
Then ``relay.learner.loop``; at its end, the trained policy is written to ``RUN_DIR/final/``
as a Hugging Face folder in ``model.dtype`` with its tokenizer
(``relay.learner.hf_export.save_final``), on a resumed run as on a fresh one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from relay.configs.lora_publish import publishes_adapters
from relay.configs.run_schema import RunConfig
from relay.configs.rundir import (
    FINAL_MODEL,
    RESOLVED_RUN,
    RESOLVED_TOPOLOGY,
    RunContext,
    configure_logging,
    load_run_dir,
)
from relay.learner.checkpoint import (
    BufferStateLink,
    CheckpointMeta,
    check_shared_checkpoints,
    load_checkpoint,
)
from relay.learner.checkpoint_lineage import run_lineage
from relay.learner.critic import Critic, load_value_model
from relay.learner.deepspeed_engine import load_zero_policy
from relay.learner.eval_queue import EvalQueue
from relay.learner.hf_export import save_final, value_model_name
from relay.learner.implicit_prm import ImplicitPRM
from relay.learner.imported_optimizer import ImportedStateError, load_imported_state
from relay.learner.loop import RankZero, Reporter, TrainLoop
from relay.learner.model import learner_device, load_sharded, sharding_mesh
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.buffer_link import BufferLink
from relay.learner.tracking import Resumed, Tracker
from relay.learner.ulysses import Parallelism, check_heads, learner_parallelism
from relay.learner.update import Learner
from relay.learner.weights import WeightServer, WeightStream
from relay.transport.sockets import Pusher

logger = logging.getLogger("relay.learner")


class Meshes:
    """The sharding meshes of the learner's models (``relay.learner.model.sharding_mesh``), one
    per ``fsdp_size``: models of the same size share a mesh and its process groups."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.made: dict[int, DeviceMesh | None] = {}

    def get(self, fsdp_size: int, key: str) -> DeviceMesh | None:
        """The mesh for ``fsdp_size`` (``key`` names it in errors); a collective the first
        time a size is asked for."""
        if fsdp_size not in self.made:
            self.made[fsdp_size] = sharding_mesh(self.device, fsdp_size, key)
        return self.made[fsdp_size]


def build_learner(ctx: RunContext, device: torch.device,
                  parallelism: Parallelism | None = None) -> Learner:
    """Every model, optimizer and schedule the run's learner needs, sharded over the world
    or, with verl's ``fsdp_size``, hybrid-sharded (``relay.learner.model.sharding_mesh``: the
    policy and the PRM by the actor's, the reference by the ref's, the critic by its own);
    under Ulysses (``actor.ulysses_sequence_parallel_size`` > 1) the heads of each model it
    loads (the policy and its reference, the critic with ``gae``, the PRM with ``prime``)
    are checked against the SP size first. Each model is read from disk on rank 0 only
    (``relay.learner.model.load_sharded``). With LoRA (``model.lora_rank`` > 0) the policy
    carries peft adapters and is its own reference, its adapters disabled
    (``relay.learner.lora``); a PRIME PRM then has a reference of its own. With
    ``actor.strategy = "deepspeed"`` the policy trains in a ZeRO engine instead
    (``relay.learner.deepspeed_engine``); every other model is FSDP2's."""
    run = ctx.run
    dtype = getattr(torch, run.model.dtype)
    estimator = run.algorithm.estimator
    critic_path = run.critic.model.path or run.model.path
    prm_path = run.reward_model.model.path or run.model.path
    sp_size = run.actor.ulysses_sequence_parallel_size
    if sp_size > 1:
        for path in sorted(run.learner_model_paths):
            check_heads(AutoConfig.from_pretrained(
                path, trust_remote_code=run.model.trust_remote_code), sp_size)
    checkpointing = run.model.enable_gradient_checkpointing
    offload = run.actor.fsdp_config.param_offload
    ref_fsdp = run.ref.resolve(run.actor).fsdp_config
    meshes = Meshes(device)
    actor_mesh = meshes.get(run.actor.fsdp_config.fsdp_size, "actor.fsdp_config.fsdp_size")
    lora = run.model.lora_rank > 0
    zero = load_zero_policy(run, device) if run.actor.strategy == "deepspeed" else None
    if zero is not None:
        model = zero.module
    else:
        model = load_sharded(run.model.path, compute_dtype=dtype, device=device,
                             trust_remote_code=run.model.trust_remote_code,
                             gradient_checkpointing=checkpointing, offload=offload,
                             compile_blocks=run.actor.use_torch_compile, mesh=actor_mesh,
                             lora=run.model if lora else None)
    if lora and (not dist.is_initialized() or dist.get_rank() == 0):
        from relay.learner.lora import log_publish_choice  # peft: the lora extra
        log_publish_choice(", ".join(sorted({p.engine for p in ctx.topology.generators})),
                           publishes_adapters(run, ctx.topology))
    prm_shares_reference = estimator.prm and prm_path == run.model.path and not lora
    reference = None
    if lora and (run.actor.use_kl_loss or run.algorithm.use_kl_in_reward):
        reference = model  # its adapters disabled: the frozen base (relay.learner.lora)
    elif run.actor.use_kl_loss or run.algorithm.use_kl_in_reward or prm_shares_reference:
        reference = load_sharded(run.model.path, compute_dtype=dtype, device=device,
                                 trust_remote_code=run.model.trust_remote_code, trainable=False,
                                 offload=bool(ref_fsdp.param_offload),
                                 mesh=meshes.get(ref_fsdp.fsdp_size, "ref.fsdp_config.fsdp_size"))
    optimizer = zero.optimizer if zero is not None else build_optimizer(model, run.actor.optim)
    scheduler = build_scheduler(optimizer, total_steps=run.trainer.total_training_steps,
                                optim=run.actor.optim)
    critic = prm = None
    if estimator.critic:
        value_model = load_value_model(critic_path, compute_dtype=dtype, device=device,
                                       trust_remote_code=run.model.trust_remote_code,
                                       gradient_checkpointing=checkpointing,
                                       mesh=meshes.get(run.critic.model.fsdp_config.fsdp_size,
                                                       "critic.model.fsdp_config.fsdp_size"),
                                       lora=run.critic.model if run.critic.model.lora_rank
                                       else None)
        critic = Critic(value_model, run.critic, total_steps=run.trainer.total_training_steps)
    if estimator.prm:
        prm_model = load_sharded(prm_path, compute_dtype=dtype, device=device,
                                 trust_remote_code=run.model.trust_remote_code,
                                 gradient_checkpointing=checkpointing, mesh=actor_mesh)
        prm_reference = reference if prm_shares_reference else load_sharded(
            prm_path, compute_dtype=dtype, device=device,
            trust_remote_code=run.model.trust_remote_code, trainable=False, mesh=actor_mesh)
        prm = ImplicitPRM(prm_model, prm_reference, run.reward_model,
                          total_steps=run.trainer.total_training_steps,
                          temperature=run.rollout.temperature)
    return Learner(model, optimizer, scheduler, actor=run.actor, algorithm=run.algorithm,
                   ref=run.ref, rollout=run.rollout, data=run.data, trainer=run.trainer,
                   reference=reference, critic=critic, prm=prm, parallelism=parallelism,
                   device=device, zero=zero)


def load_imported_optimizers(learner: Learner, run: RunConfig, resumed: bool) -> None:
    """``actor.optim.state_path`` and ``critic.optim.state_path``: AdamW state that ``relay
    import-verl --optimizer`` wrote, put into the fresh optimizers
    (``relay.learner.imported_optimizer``); a resumed run keeps its checkpoint's."""
    imports = [("actor.optim.state_path", run.actor.optim.state_path, learner.model,
                learner.optimizer, lambda name: name)]
    if learner.critic is not None:
        imports.append(("critic.optim.state_path", run.critic.optim.state_path,
                        learner.critic.model, learner.critic.optimizer, value_model_name))
    for key, path, model, optimizer, rename in imports:
        if not path:
            continue
        if resumed:
            logger.info("%s not loaded: the run resumed, and its checkpoint holds its "
                        "optimizer", key)
            continue
        try:
            said = load_imported_state(model, optimizer, Path(path), key, rename)
        except ImportedStateError as exc:
            raise SystemExit(f"relay.learner.main: {exc}") from None
        if dist.get_rank() == 0:
            logger.info("%s", said)


def build_rank_zero(ctx: RunContext, tokenizer: PreTrainedTokenizerBase,
                    resumed: CheckpointMeta | None) -> RankZero:
    run = ctx.run
    tracker = Tracker(uri=run.tracking.uri, experiment=run.tracking.experiment,
                      run_name=run.tracking.run_name, run_dir=ctx.run_dir,
                      loggers=run.tracking.loggers, wandb_mode=run.tracking.wandb_mode,
                      resumed=Resumed(step=resumed.loop.step, run_id=resumed.mlflow_run_id)
                      if resumed is not None else None)
    tracker.log_config(run, [ctx.run_dir / RESOLVED_RUN, ctx.run_dir / RESOLVED_TOPOLOGY])
    reporter = Reporter(tracker, Pusher(ctx.metrics_endpoint, keys=ctx.client_keys()))
    patience_s = run.buffer.client_patience_s
    return RankZero(link=BufferLink(ctx.buffer_endpoint, patience_s, keys=ctx.client_keys()),
                    buffer_state=BufferStateLink(ctx.buffer_endpoint, patience_s,
                                                 keys=ctx.client_keys()),
                    weights=WeightServer(ctx.weights_endpoint, keys=ctx.server_keys(),
                                         evaluation=EvalQueue(run.trainer.max_waiting_evals)
                                         ).start(),
                    stream=WeightStream(ctx.weights_stream_endpoint, keys=ctx.server_keys()),
                    reporter=reporter, tokenizer=tokenizer)


def init_learner_group(device: torch.device, timeout: timedelta) -> None:
    """The learner's default process group: on a GPU, gloo for CPU tensors' collectives and
    NCCL for CUDA tensors', bound to ``device`` (as verl does); on the CPU, gloo. Under
    torchrun (``WORLD_SIZE`` > 1) the ranks meet through its store; a learner of one rank
    (started alone on one host: ``relay.launcher.plan``) is a group of one on a store in its own
    memory, so that no rendezvous port is opened, whatever ``MASTER_PORT`` it inherited (a
    parent running a process group of its own holds that port)."""
    alone = {} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {
        "store": dist.HashStore(), "rank": 0, "world_size": 1}
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timeout,
                                **alone)
    else:
        dist.init_process_group("gloo", timeout=timeout, **alone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m relay.learner.main")
    parser.add_argument("--run-dir", required=True, help="run directory written by the launcher")
    args = parser.parse_args(argv)
    configure_logging()
    ctx = load_run_dir(args.run_dir)
    run = ctx.run
    placement = ctx.topology.learner
    if placement.threads:
        torch.set_num_threads(placement.threads)
    device = learner_device(placement.device, int(os.environ.get("LOCAL_RANK", 0)))
    init_learner_group(device, timeout=timedelta(minutes=30))
    cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    rank = dist.get_rank()
    check_shared_checkpoints(ctx.checkpoint_dir, ctx.resume_from, hosts=len(placement.hosts),
                             saves=run.trainer.save_freq > 0, group=cpu_group)
    torch.manual_seed(run.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(run.model.path,
                                              trust_remote_code=run.model.trust_remote_code)
    # Padding sits under attention_mask = 0 and off the response: any valid id will do.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    parallelism = learner_parallelism(device, run.actor.ulysses_sequence_parallel_size)
    learner = build_learner(ctx, device, parallelism)
    resumed = None
    if ctx.resume_from is not None:
        resumed = load_checkpoint(learner, ctx.resume_from)
        logger.info("resumed from %s: step %d, weights version %d", ctx.resume_from,
                    resumed.loop.step, resumed.loop.version)
    load_imported_optimizers(learner, run, resumed=resumed is not None)
    lineage = run_lineage(ctx.checkpoint_dir, ctx.resume_from, group=cpu_group)
    rank0 = build_rank_zero(ctx, tokenizer, resumed) if rank == 0 else None
    loop = TrainLoop(run, learner, pad_id=pad, checkpoint_dir=ctx.checkpoint_dir,
                     lineage=lineage, rank0=rank0, group=cpu_group,
                     publish_adapters=publishes_adapters(run, ctx.topology))
    if resumed is not None:
        loop.resume(resumed.loop)
    ok = False
    try:
        loop.run_all()
        with learner.full_policy():
            final = save_final(learner.model, ctx.run_dir / FINAL_MODEL,
                               getattr(torch, run.model.dtype),
                               tokenizer=tokenizer if rank == 0 else None, group=cpu_group)
        ok = True
    finally:
        if rank0 is not None:
            rank0.close(ok)
        dist.destroy_process_group()
    logger.info("learner finished %d steps at version %d; the trained policy is in %s",
                run.trainer.total_training_steps, loop.version, final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
