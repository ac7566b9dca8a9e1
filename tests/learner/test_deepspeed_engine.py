"""DeepSpeed ZeRO trains the policy to the weights one FSDP2 rank trains it to.

Two ranks (gloo, real processes) under ``actor.strategy = "deepspeed"`` take two learner
steps on the batch ``tests/learner/test_ranks.py`` gives one FSDP2 rank, and must end at its
losses and weights (the same tolerance as two FSDP2 ranks): ZeRO-2 with a KL loss against
an FSDP2 reference beside it, ZeRO-3 with the optimizer offloaded to the CPU. The engine's
full state (fp32 weights, Adam moments, step) goes into a fresh engine of another stage
and the next step is the same; a checkpoint written under DeepSpeed resumes under FSDP2,
and under bf16 its ``hf/`` holds the fp32 masters, not the module's rounded weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import collate
from relay.configs.run_schema import (ActorConfig, AlgorithmConfig, DataConfig,
                                      DeepSpeedConfig, ModelConfig, OptimConfig, RunConfig)
from relay.learner.checkpoint import LoopState, load_checkpoint, save_checkpoint
from relay.learner.deepspeed_engine import engine_config, load_zero_policy
from relay.learner.model import load_sharded
from relay.learner.optim import build_scheduler
from relay.learner.update import Learner, with_last

from ..conftest import exit_worker, free_port, gather_full_weights
from .test_checkpoint import ACTOR, BUFFER, RUN
from .test_ranks import assert_same_update, save_two_steps
from .test_update import DATA, LR, ROLLOUT, rollouts
from .test_update_algorithms import make_learner

pytest.importorskip("deepspeed")


def ds_run(model_dir: str, settings: DeepSpeedConfig, actor: ActorConfig,
           dtype: str = "float32") -> RunConfig:
    return RunConfig(data=DataConfig(train_files=[]),
                     model=ModelConfig(path=model_dir, dtype=dtype),
                     actor=ActorConfig(**{**{f: getattr(actor, f) for f in actor.__struct_fields__},
                                          "strategy": "deepspeed", "deepspeed": settings}))


def ds_learner(model_dir: str, settings: DeepSpeedConfig, algorithm: AlgorithmConfig,
               actor: ActorConfig, dtype: str = "float32") -> Learner:
    """A learner whose policy is in a ZeRO engine (``relay.learner.main.build_learner``'s
    wiring); a KL loss's reference is an FSDP2 model beside it."""
    zero = load_zero_policy(ds_run(model_dir, settings, actor, dtype), torch.device("cpu"))
    reference = load_sharded(model_dir, compute_dtype=torch.float32, device=torch.device("cpu"),
                             trainable=False) if actor.use_kl_loss else None
    return Learner(zero.module, zero.optimizer,
                   build_scheduler(zero.optimizer, total_steps=10, optim=actor.optim),
                   actor=actor, algorithm=algorithm, rollout=ROLLOUT, data=DATA,
                   reference=reference, zero=zero)


def train_two_steps(rank: int, world: int, port: int, model_dir: str, batch_file: str,
                    settings: DeepSpeedConfig | None, actor: ActorConfig, out_file: str) -> None:
    """Two learner steps on the batch; ``settings`` None: FSDP2."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        learner = make_learner(Path(model_dir), actor=actor) if settings is None else \
            ds_learner(model_dir, settings, AlgorithmConfig(), actor)
        save_two_steps(learner, batch, rank, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


CASES = {
    "zero2 + kl loss": (DeepSpeedConfig(zero_stage=2),
                        ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                                    use_kl_loss=True, kl_loss_coef=0.1)),
    "zero3 + offloaded optimizer": (DeepSpeedConfig(zero_stage=3, offload_optimizer=True),
                                    ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0))),
}
SLOW = {"zero3 + offloaded optimizer"}  # ~40 s each on 2 cores: one case in the default tier


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW
                                  else case for case in CASES])
def test_two_deepspeed_ranks_match_one_fsdp2_rank(case: str, random_model_dir: Path,
                                                  tmp_path: Path) -> None:
    settings, actor = CASES[case]
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    batch_file = tmp_path / "batch.pt"
    torch.save(collate(rollouts(engine, 1), pad_id=0), batch_file)
    results = []
    for world, strategy in ((1, None), (2, settings)):
        out = tmp_path / f"world{world}.pt"
        mp.start_processes(train_two_steps, nprocs=world, start_method="spawn", args=(
            world, free_port(), str(random_model_dir), str(batch_file), strategy, actor,
            str(out)))
        results.append(torch.load(out, weights_only=False))
    assert_same_update(*results)


def checkpoint_worker(rank: int, world: int, port: int, model_dir: str, batches_file: str,
                      folder: str, out_file: str) -> None:
    """``world`` ranks: a ZeRO-2 learner takes two steps and saves a checkpoint, then its
    third; a fresh ZeRO-3 learner resumes from the checkpoint and takes the third too."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        batches = torch.load(batches_file, weights_only=False)
        trained = ds_learner(model_dir, DeepSpeedConfig(zero_stage=2), AlgorithmConfig(), ACTOR)
        for batch in batches[:2]:
            trained.step(batch)
        save_checkpoint(trained, Path(folder), LoopState(step=2, version=2), lineage=RUN,
                        keep_last=2, buffer=BUFFER, mlflow_run_id="run-1")
        uninterrupted = trained.step(batches[2]).metrics["actor/loss"]
        with trained.full_policy():
            expected = gather_full_weights(trained.model, torch.float32)
        resumed = ds_learner(model_dir, DeepSpeedConfig(zero_stage=3), AlgorithmConfig(), ACTOR)
        load_checkpoint(resumed, Path(folder) / "step-2")
        again = resumed.step(batches[2]).metrics["actor/loss"]
        with resumed.full_policy():
            got = gather_full_weights(resumed.model, torch.float32)
        if rank == 0:
            torch.save({"losses": [uninterrupted, again], "expected": expected, "got": got},
                       out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow  # two engines at two ranks: ~60 s on 2 cores
@pytest.mark.usefixtures("one_rank_group")
def test_a_deepspeed_checkpoint_resumes_under_zero_3_and_under_fsdp2(
        random_model_dir: Path, tmp_path: Path) -> None:
    """The checkpoint is FSDP2's layout (fp32 weights and Adam's state by parameter name):
    another ZeRO stage and FSDP2 at one rank resume it and take the step it took."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    batches = [collate(rollouts(engine, step), pad_id=0) for step in range(3)]
    batches_file, out = tmp_path / "batches.pt", tmp_path / "out.pt"
    torch.save(batches, batches_file)
    folder = tmp_path / "checkpoints"
    mp.start_processes(checkpoint_worker, nprocs=2, start_method="spawn", args=(
        2, free_port(), str(random_model_dir), str(batches_file), str(folder), str(out)))
    result = torch.load(out, weights_only=False)
    uninterrupted, again = result["losses"]
    assert again == pytest.approx(uninterrupted, abs=1e-6)
    for name, tensor in result["expected"].items():
        torch.testing.assert_close(result["got"][name], tensor, atol=1e-6, rtol=1e-5)

    fsdp2 = make_learner(random_model_dir, actor=ACTOR)  # one rank, in this process
    assert load_checkpoint(fsdp2, folder / "step-2").parts == ["policy"]
    metrics = fsdp2.step(batches[2]).metrics
    assert_same_update({"losses": [uninterrupted], "rejected": [0.0],
                        "weights": result["expected"]},
                       {"losses": [metrics["actor/loss"]], "rejected": [0.0],
                        "weights": gather_full_weights(fsdp2.model, torch.float32)})


def test_the_engine_config_clips_offloads_and_reduces_in_fp32() -> None:
    config = engine_config(DeepSpeedConfig(zero_stage=3, offload_optimizer=True,
                                           offload_param=True),
                           grad_clip=0.5, dtype=torch.bfloat16)
    assert config["gradient_clipping"] == 0.5
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["bf16"] == {"enabled": True}
    assert config["communication_data_type"] == "fp32"


def test_offloading_parameters_needs_zero_3() -> None:
    with pytest.raises(ValueError, match="offload_param needs zero_stage = 3"):
        DeepSpeedConfig(zero_stage=2, offload_param=True)


def test_with_last_marks_only_the_last_item() -> None:
    assert list(with_last("abc")) == [("a", False), ("b", False), ("c", True)]
    assert list(with_last([])) == []


def bf16_checkpoint_worker(rank: int, port: int, model_dir: str, batch_file: str,
                           folder: str, out_file: str) -> None:
    """One ZeRO-2 rank in bf16 takes a step and saves a checkpoint; its fp32 masters and
    its module's bf16 weights go to ``out_file``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        learner = ds_learner(model_dir, DeepSpeedConfig(zero_stage=2), AlgorithmConfig(),
                             ActorConfig(optim=OptimConfig(lr=1e-3)), dtype="bfloat16")
        learner.step(torch.load(batch_file, weights_only=False))
        save_checkpoint(learner, Path(folder), LoopState(step=1, version=1), lineage=RUN,
                        keep_last=2, buffer=BUFFER, mlflow_run_id="run-1")
        torch.save({"masters": learner.zero.full_state()[0],
                    "module": {n: p.detach().clone()
                               for n, p in learner.model.named_parameters()}}, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_a_bf16_deepspeed_checkpoint_holds_the_fp32_masters_in_hf(random_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Under bf16 the engine's module holds the masters rounded; ``hf/`` (what ``relay
    export`` reads) holds the masters, as FSDP2's fp32 shards give them."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    batch_file, out = tmp_path / "batch.pt", tmp_path / "out.pt"
    torch.save(collate(rollouts(engine, 1), pad_id=0), batch_file)
    mp.start_processes(bf16_checkpoint_worker, nprocs=1, start_method="spawn", args=(
        free_port(), str(random_model_dir), str(batch_file), str(tmp_path / "ckpt"), str(out)))
    result = torch.load(out, weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "step-1" / "hf",
                                              dtype=torch.float32)
    saved = dict(hf.named_parameters())
    assert saved.keys() <= result["masters"].keys()
    for name, weight in saved.items():
        assert torch.equal(weight, result["masters"][name]), name
    name = "model.layers.0.mlp.up_proj.weight"
    assert result["module"][name].dtype == torch.bfloat16
    assert not torch.equal(result["module"][name].float(), saved[name])  # masters, not bf16
