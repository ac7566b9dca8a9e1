"""A LoRA critic (``critic.model.lora_rank`` > 0): only the body's adapters and the value
head train, the base stays bitwise as it was; its target modules are checked naming
``critic.model.target_modules``; the merged critic (W + (alpha / r) B A, head kept) loads as
``AutoModelForTokenClassification`` and predicts the learner's values; a checkpoint holds
its adapters and head, exports merged and resumes to the same next step; two FSDP2 ranks
train it three steps leaving the base bitwise, their merged export predicting their values."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

from relay.export import export
from relay.configs.run_schema import (ActorConfig, AlgorithmConfig, CriticConfig,
                                      CriticModelConfig, OptimConfig, TrainerConfig)
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import TrainBatch, collate
from relay.learner.critic import Critic, ValueModel, load_value_model
from relay.learner.hf_export import value_model_as_token_classification, write_state
from relay.learner.checkpoint import CRITIC_ADAPTER_FOLDER, load_checkpoint, save_checkpoint
from relay.learner.checkpoint_meta import Lineage, LoopState
from relay.learner.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, HEAD_WEIGHTS, merged_state
from relay.learner.model import load_sharded
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.update import Learner

from ..conftest import exit_worker, free_port, gather_full_weights
from .test_update import DATA, LR, ROLLOUT, rollouts

pytestmark = pytest.mark.usefixtures("one_rank_group")
RANK, ALPHA = 4, 8.0
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 271, 201, 273, 272, 223, 19, 20], [1, 24, 25, 26, 27, 2, 201, 278]])


def lora_critic(path: Path, **keys: object) -> ValueModel:
    keys = dict(lora_rank=RANK, lora_alpha=ALPHA) | keys
    return load_value_model(str(path), compute_dtype=torch.float32, device=CPU,
                            lora=CriticModelConfig(**keys))


def trains(name: str) -> bool:
    return ".lora_" in name or name.startswith("value_head.")


def gae_learner(path: Path) -> Learner:
    """A full-parameter policy and a LoRA critic, wired as ``build_learner`` wires them."""
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0))
    model = load_sharded(str(path), compute_dtype=torch.float32, device=CPU)
    optimizer = build_optimizer(model, actor.optim)
    critic = Critic(lora_critic(path), CriticConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.0)),
                    total_steps=10)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10,
                                                     optim=actor.optim),
                   actor=actor, algorithm=AlgorithmConfig(adv_estimator="gae"),
                   rollout=ROLLOUT, data=DATA, trainer=TrainerConfig(), critic=critic)


@pytest.fixture(scope="module")
def batch(random_model_dir: Path) -> TrainBatch:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=3)
    return collate(rollouts(engine, 1), pad_id=0)


def test_only_the_adapters_and_the_value_head_train(random_model_dir: Path) -> None:
    critic = Critic(lora_critic(random_model_dir), CriticConfig(), total_steps=1)
    names = [name for name, _ in critic.model.named_parameters()]
    trainable = {name for name, p in critic.model.named_parameters() if p.requires_grad}
    assert trainable == {name for name in names if trains(name)}
    assert any(".lora_A." in n for n in trainable) and "value_head.weight" in trainable
    held = {id(p) for group in critic.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in critic.model.parameters() if p.requires_grad}


def test_a_critic_target_module_the_body_lacks_is_refused_naming_the_key(
        random_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"critic\.model\.target_modules.*qkv_proj"):
        lora_critic(random_model_dir, target_modules=["q_proj", "qkv_proj"])


def test_a_gae_step_moves_the_adapters_and_head_not_the_base(random_model_dir: Path,
                                                             batch: TrainBatch) -> None:
    learner = gae_learner(random_model_dir)
    before = {name: tensor.clone()  # one rank's full_tensor() is the parameter itself
              for name, tensor in gather_full_weights(learner.critic.model, torch.float32).items()}
    for _ in range(3):  # the head starts at 0: step 1 moves it, step 2 B, step 3 A too
        learner.step(batch)
    after = gather_full_weights(learner.critic.model, torch.float32)
    for name, tensor in before.items():
        if trains(name):
            assert not torch.equal(after[name], tensor), name
        else:
            assert torch.equal(after[name], tensor), name


def test_the_merged_critic_loads_as_token_classification_with_the_same_values(
        random_model_dir: Path, batch: TrainBatch, tmp_path: Path) -> None:
    learner = gae_learner(random_model_dir)
    for _ in range(2):
        learner.step(batch)
    critic = learner.critic.model
    with torch.no_grad():
        values = critic(IDS)
    state = merged_state(gather_full_weights(critic, torch.float32), ALPHA / RANK)
    config = AutoConfig.from_pretrained(random_model_dir, num_labels=1)
    body = AutoModelForTokenClassification.from_config(config)
    write_state(value_model_as_token_classification(state, body.base_model_prefix),
                config, AutoModelForTokenClassification, tmp_path / "critic", torch.float32)
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    with torch.no_grad():
        torch.testing.assert_close(exported(IDS).logits.squeeze(-1), values,
                                   atol=1e-5, rtol=1e-5)
    assert values.abs().max() > 1e-3  # a trained head, not the zero one


def test_a_lora_critic_checkpoint_holds_its_adapters_exports_merged_and_resumes(
        random_model_dir: Path, batch: TrainBatch, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise equal steps (tests/learner/test_checkpoint.py)
    try:
        torch.manual_seed(3)
        trained = gae_learner(random_model_dir)
        for version in range(3):
            trained.step(batch, version=version)
        folder = save_checkpoint(trained, tmp_path, LoopState(step=3, version=3),
                                 lineage=Lineage(id="run"), keep_last=2,
                                 tokenizer=AutoTokenizer.from_pretrained(random_model_dir))
        with torch.no_grad():
            values = trained.critic.model(IDS)
        uninterrupted = trained.step(batch, version=3)

        saved = folder / CRITIC_ADAPTER_FOLDER
        assert (saved / ADAPTER_CONFIG).is_file()
        assert any(".lora_B." in name for name in load_file(str(saved / ADAPTER_WEIGHTS)))
        assert sorted(load_file(str(saved / HEAD_WEIGHTS))) == ["bias", "weight"]
        export(folder, tmp_path / "critic", dtype="float32", part="critic")
        exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
        with torch.no_grad():
            torch.testing.assert_close(exported(IDS).logits.squeeze(-1), values,
                                       atol=1e-5, rtol=1e-5)

        torch.manual_seed(4)  # other fresh adapters, replaced by the checkpoint's
        resumed = gae_learner(random_model_dir)
        load_checkpoint(resumed, folder)
        again = resumed.step(batch, version=3)
        assert again.metrics == uninterrupted.metrics
        after = gather_full_weights(resumed.critic.model, torch.float32)
        assert all(torch.equal(after[k], v) for k, v
                   in gather_full_weights(trained.critic.model, torch.float32).items())
    finally:
        torch.set_num_threads(threads)


def train_lora_critic_ranks(rank: int, world: int, port: int, model_dir: str, batch_file: str,
                            out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        learner = gae_learner(Path(model_dir))
        critic = learner.critic.model
        before = {n: t.clone() for n, t in gather_full_weights(critic, torch.float32).items()}
        with torch.no_grad():
            first = critic(IDS)
        for version in range(3):
            learner.step(batch, version=version)
        after = gather_full_weights(critic, torch.float32)
        with torch.no_grad():
            values = critic(IDS)
        if rank == 0:
            torch.save({"before": before, "after": after, "first": first, "values": values},
                       Path(out) / "state.pt")
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow  # 2 processes, 3 PPO steps: 10 s alone, more on a busy 2-core machine
def test_two_ranks_train_a_lora_critic_leaving_its_base(random_model_dir: Path,
                                                        batch: TrainBatch,
                                                        tmp_path: Path) -> None:
    torch.save(batch, tmp_path / "batch.pt")
    mp.start_processes(train_lora_critic_ranks,
                       args=(2, free_port(), str(random_model_dir), str(tmp_path / "batch.pt"),
                             str(tmp_path)), nprocs=2, start_method="spawn")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    before, after = state["before"], state["after"]
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor) != trains(name), name
    assert not torch.allclose(state["values"], state["first"])
    config = AutoConfig.from_pretrained(random_model_dir, num_labels=1)
    prefix = AutoModelForTokenClassification.from_config(config).base_model_prefix
    write_state(value_model_as_token_classification(merged_state(after, ALPHA / RANK), prefix),
                config, AutoModelForTokenClassification, tmp_path / "critic", torch.float32)
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    with torch.no_grad():
        torch.testing.assert_close(exported(IDS).logits.squeeze(-1), state["values"],
                                   atol=1e-5, rtol=1e-5)
