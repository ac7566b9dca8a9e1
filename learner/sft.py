"""Supervised fine-tuning on the learner's building blocks (verl's ``fsdp_sft_trainer``).

``torchrun ... -m relay.learner.sft --config SFT.toml`` (``relay sft`` starts it), or one
rank without torchrun. The model is loaded and FSDP2-sharded as the RL learner's policy
(``relay.learner.model.load_sharded``: fp32 master weights computing in ``model.dtype``,
optional activation checkpointing), trained with its AdamW and schedule
(``relay.learner.optim``), cut into passes by its micro-batcher
(``relay.learner.micro_batches``: ``micro_batch_size_per_gpu`` rows, or with
``data.use_dynamic_bsz`` a token budget of ``max_token_len_per_gpu`` a pass), packed without
padding (``use_remove_padding``) and split over Ulysses groups
(``ulysses_sequence_parallel_size``: ``relay.learner.ulysses``), tracked in MLflow
(``relay.learner.tracking``), checkpointed by ``relay.learner.sft_checkpoint``.

Data order. Epoch e visits the training rows in the order of ``torch.randperm`` seeded with
``trainer.seed + e``, in batches of ``data.train_batch_size`` (the last partial batch is
dropped, as verl's sampler does); step s (1-based) takes batch ``(s - 1) mod S`` of epoch
``(s - 1) // S`` (S steps an epoch), so a resumed run needs only the step.

Loss. The token mean of the negative log-likelihood over the batch's loss tokens
(``relay.learner.sft_data``: responses, or every assistant turn), across micro-batches and
ranks, as verl's:

    L = - (sum over rows b, loss tokens t of log p(x_{b,t} | x_{b,<t})) / N

with N the number of loss tokens in the whole batch. Each pass adds its share
``- sum log p / N``, multiplied by the world size W because FSDP2 averages gradients over
the ranks (``MicroBatches.grad_scale``), so the update does not depend on ranks, SP groups
or micro-batches. Gradients are clipped to ``optim.clip_grad`` (a non-finite norm skips the
step: ``relay.learner.optim.clipped_step``). ``val/loss`` is the same mean over all of
``data.val_files``, every ``trainer.test_freq`` steps and at the end.

LoRA (``model.lora_rank`` > 0): peft adapters wrap the model before it is sharded
(``relay.learner.lora``); only they train and hold optimizer state.

Output. ``default_local_dir/final``: the trained model (float32; with LoRA the merged
weights W + (alpha / r) B A under the base model's names) and its tokenizer, a Hugging Face
folder that an RL run takes as ``actor_rollout_ref.model.path``. Rank 0 prints
a progress line a step (``trainer.logger`` with ``console``) and logs ``train/loss``,
``train/lr``, ``train/grad_norm``, ``train/tokens`` and ``val/loss`` to MLflow.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from relay.configs.loader import ConfigError, to_toml
from relay.configs.rundir import configure_logging
from relay.configs.sft_schema import SftConfig, load_sft_config
from relay.learner.batch import TrainBatch
from relay.learner.hf_export import save_final
from relay.learner.main import init_learner_group
from relay.learner.micro_batches import MicroBatches
from relay.learner.model import back_to_shards, forward_logprobs, learner_device, load_sharded
from relay.learner.optim import build_optimizer, build_scheduler, clipped_step
from relay.learner.sft_checkpoint import (
    load_sft_checkpoint,
    newest_checkpoint,
    save_sft_checkpoint,
)
from relay.learner.sft_data import SftExample, collate_examples, load_examples
from relay.learner.tracking import Resumed, Tracker, default_uri
from relay.learner.ulysses import Parallelism, check_heads, learner_parallelism

logger = logging.getLogger("relay.sft")

FINAL_MODEL = "final"
RESOLVED_CONFIG = "sft.toml"
EXTRA_TRACKERS = ("wandb", "tensorboard", "swanlab")


def steps_per_epoch(rows: int, batch_size: int) -> int:
    """Whole batches in an epoch; ValueError naming the key when there is none."""
    if rows < batch_size:
        raise ValueError(f"data.train_batch_size = {batch_size} is more than the {rows} "
                         "training rows")
    return rows // batch_size


def total_steps(config: SftConfig, rows: int) -> int:
    """``trainer.total_training_steps``, else ``total_epochs`` epochs."""
    per_epoch = steps_per_epoch(rows, config.data.train_batch_size)
    return config.trainer.total_training_steps or per_epoch * config.trainer.total_epochs


def batch_rows(step: int, rows: int, batch_size: int, seed: int) -> list[int]:
    """The training rows of ``step`` (1-based; module docstring)."""
    per_epoch = steps_per_epoch(rows, batch_size)
    epoch, index = divmod(step - 1, per_epoch)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch))
    return order[index * batch_size:(index + 1) * batch_size].tolist()


class SftTrainer:
    """The model, optimizer and schedule of one SFT run, and its steps."""

    def __init__(self, config: SftConfig, model: nn.Module, device: torch.device,
                 total: int, parallelism: Parallelism) -> None:
        self.config, self.model, self.device, self.total = config, model, device, total
        self.optimizer = build_optimizer(model, config.optim.as_optim())
        self.scheduler = build_scheduler(self.optimizer, total_steps=total,
                                         optim=config.optim.as_optim())
        self.sp = parallelism.sequence
        self.data_group = parallelism.data_group
        data = config.data
        self.cutter = MicroBatches(
            groups_per_mini_batch=data.train_batch_size,
            micro_batch_size=data.micro_batch_size_per_gpu,
            max_token_len=data.max_token_len_per_gpu if data.use_dynamic_bsz else None,
            group=self.data_group, sp=self.sp)

    def _nll_passes(self, batch: TrainBatch, tokens: float, backward: bool) -> torch.Tensor:
        """Sum over this rank's passes of ``- sum log p`` of their loss tokens (weighted:
        stand-in passes count 0), with each pass's ``share * W / tokens`` backpropagated
        when ``backward``."""
        nll = torch.zeros((), dtype=torch.float64, device=self.device)
        every = torch.arange(batch.rows, device=batch.input_ids.device)
        for part in self.cutter.passes(batch, every):
            logprobs, _ = forward_logprobs(self.model, part.part, 1.0, False, sp=self.sp)
            share = -(logprobs * part.part.response_mask).sum() * part.weight
            if backward:
                (share * self.cutter.grad_scale / tokens).backward()
            nll += share.detach().double()
        return nll

    def _data_sum(self, value: torch.Tensor) -> float:
        """``value`` summed over the data-parallel ranks (an SP group's ranks hold the
        same)."""
        if dist.is_initialized():
            dist.all_reduce(value, group=self.data_group)
        return float(value)

    def train_step(self, examples: list[SftExample], pad_id: int) -> dict[str, float]:
        """One optimizer step on ``examples`` (the whole batch; every rank holds it)."""
        started = time.perf_counter()
        batch = collate_examples(examples, pad_id).to(self.device)
        tokens = float(batch.response_mask.sum())
        self.model.train()
        nll = self._nll_passes(batch, tokens, backward=True)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = clipped_step(self.model, self.optimizer, self.config.optim.clip_grad,
                                 device=self.device)
        self.scheduler.step()
        return {"train/loss": self._data_sum(nll) / tokens, "train/lr": lr,
                "train/grad_norm": grad_norm, "train/tokens": tokens,
                "perf/step_time_s": time.perf_counter() - started}

    @torch.no_grad()
    def validate(self, examples: list[SftExample], pad_id: int) -> float:
        """The token-mean NLL over ``examples`` (batches of ``data.train_batch_size``)."""
        self.model.eval()
        nll, tokens = 0.0, 0.0
        size = self.config.data.train_batch_size
        for start in range(0, len(examples), size):
            batch = collate_examples(examples[start:start + size], pad_id).to(self.device)
            tokens += float(batch.response_mask.sum())
            nll += self._data_sum(self._nll_passes(batch, tokens=1.0, backward=False))
        back_to_shards(self.model)
        return nll / tokens


def resume_point(config: SftConfig, out: Path) -> Path | None:
    """The checkpoint to resume from (``trainer.resume_mode``), or None."""
    mode = config.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        return Path(config.trainer.resume_from_path or "")
    return newest_checkpoint(out)


def due(step: int, freq: int, last: int) -> bool:
    """Whether a ``freq``-periodic action (-1: at the end only) falls on ``step``."""
    return step == last or (freq > 0 and step % freq == 0)


def progress_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}", f"loss {metrics['train/loss']:.4f}"]
    if "val/loss" in metrics:
        parts.append(f"val/loss {metrics['val/loss']:.4f}")
    parts += [f"lr {metrics['train/lr']:.3g}", f"grad_norm {metrics['train/grad_norm']:.3f}",
              f"{metrics['perf/step_time_s']:.2f} s"]
    return "sft " + "  ".join(parts)


def check_model(config: SftConfig) -> None:
    """Ulysses needs the model's heads to fit ``ulysses_sequence_parallel_size``."""
    if config.ulysses_sequence_parallel_size > 1:
        check_heads(AutoConfig.from_pretrained(
            config.model.partial_pretrain, trust_remote_code=config.model.trust_remote_code),
            config.ulysses_sequence_parallel_size)


def run(config: SftConfig) -> Path:
    """The SFT run of ``config`` on this process's rank (the process group is set up and
    torn down here); returns the final model's folder."""
    device = learner_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
    init_learner_group(device, timeout=timedelta(minutes=30))
    try:
        return _run(config, device)
    finally:
        dist.destroy_process_group()


def _run(config: SftConfig, device: torch.device) -> Path:
    rank = dist.get_rank()
    cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    out = config.trainer.output_dir()
    torch.manual_seed(config.trainer.seed)
    model_config = config.model
    tokenizer = AutoTokenizer.from_pretrained(model_config.partial_pretrain,
                                              trust_remote_code=model_config.trust_remote_code)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = load_examples(config.data.train_list(), tokenizer, config.data)
    val = load_examples(config.data.val_list(), tokenizer, config.data) \
        if config.data.val_list() else []
    total = total_steps(config, len(train))
    check_model(config)
    parallelism = learner_parallelism(device, config.ulysses_sequence_parallel_size,
                                      packed=config.use_remove_padding,
                                      key="ulysses_sequence_parallel_size",
                                      ranks="trainer.n_gpus_per_node")
    model = load_sharded(model_config.partial_pretrain,
                         compute_dtype=getattr(torch, model_config.dtype), device=device,
                         trust_remote_code=model_config.trust_remote_code,
                         gradient_checkpointing=model_config.enable_gradient_checkpointing,
                         lora=model_config.lora())
    trainer = SftTrainer(config, model, device, total, parallelism)
    start, resumed = 0, None
    checkpoint = resume_point(config, out)
    if checkpoint is not None:
        meta = load_sft_checkpoint(model, trainer.optimizer, trainer.scheduler, checkpoint)
        start, resumed = meta.step, Resumed(step=meta.step, run_id=meta.mlflow_run_id)
        if rank == 0:
            logger.info("resuming from %s at step %d of %d", checkpoint, start, total)
    tracker = _tracker(config, out, resumed) if rank == 0 else None
    ok = False
    try:
        for step in range(start + 1, total + 1):
            rows = batch_rows(step, len(train), config.data.train_batch_size,
                              config.trainer.seed)
            metrics = trainer.train_step([train[i] for i in rows], pad)
            if val and due(step, config.trainer.test_freq, total):
                metrics["val/loss"] = trainer.validate(val, pad)
            if tracker is not None:
                tracker.log_metrics(metrics, step)
                if "console" in config.trainer.logger:
                    logger.info("%s", progress_line(step, total, metrics))
            if due(step, config.trainer.save_freq, total):
                save_sft_checkpoint(model, trainer.optimizer, trainer.scheduler, out, step,
                                    tokenizer=tokenizer if rank == 0 else None,
                                    mlflow_run_id=tracker.run_id if tracker else "",
                                    keep=config.trainer.max_ckpt_to_keep, group=cpu_group)
        final = save_final(model, out / FINAL_MODEL, torch.float32,
                           tokenizer=tokenizer if rank == 0 else None, group=cpu_group)
        ok = True
    finally:
        if tracker is not None:
            tracker.close(ok)
    if rank == 0:
        logger.info("sft finished %d steps; the trained model is in %s", total, final)
    return final


def _tracker(config: SftConfig, out: Path, resumed: Resumed | None) -> Tracker:
    trainer = config.trainer
    tracker = Tracker(uri=trainer.tracking_uri or default_uri(out),
                      experiment=trainer.project_name, run_name=trainer.experiment_name,
                      run_dir=out, resumed=resumed,
                      loggers=[name for name in trainer.logger if name in EXTRA_TRACKERS])
    tracker.log_config(config, [out / RESOLVED_CONFIG] if (out / RESOLVED_CONFIG).is_file()
                       else [])
    return tracker


def write_resolved(config: SftConfig) -> Path:
    """``default_local_dir/sft.toml``: the config every rank reads (paths absolute)."""
    out = config.trainer.output_dir().resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = msgspec.structs.replace(config, trainer=msgspec.structs.replace(
        config.trainer, default_local_dir=str(out)))
    path = out / RESOLVED_CONFIG
    path.write_bytes(to_toml(config))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m relay.learner.sft")
    parser.add_argument("--config", required=True, help="the resolved SFT config (TOML)")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        config = load_sft_config(args.config)
    except ConfigError as exc:
        print(f"relay sft: {exc}", file=sys.stderr)
        return 2
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
