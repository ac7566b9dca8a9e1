"""LoRA on the policy (``relay.learner.lora``): only the adapters train, the publish sends
the merged weights W + (alpha / r) B A under the base model's names, the reference is the
base (adapters disabled), the adapters save in peft's format; two FSDP2 ranks train three
steps leaving the base weights bitwise as they were, their merged export and published
weights matching, the lean engine generating with them; a checkpoint holds the adapters,
exports merged and resumes; Ulysses (SP 2) gives the adapters one process's gradients;
vLLM's CPU build generates with a published version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from relay.configs.run_schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimConfig
from relay.export import export
from relay.generators.lean_engine import LeanEngine
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine
from relay.learner.attention import ATTENTION
from relay.learner.batch import collate
from relay.learner.checkpoint import ADAPTER_FOLDER, load_checkpoint, save_checkpoint
from relay.learner.checkpoint_meta import Lineage, LoopState
from relay.learner.hf_export import save_hf
from relay.learner.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapters_disabled,
                                is_lora, save_adapter, wrap, write_merged)
from relay.learner.logprob_head import position_logprobs
from relay.learner.memory_plan import (LearnerModels, count_adapters, count_parameters,
                                       plan_learner)
from relay.learner.model import block_classes, forward_logprobs, load_sharded, shard
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.ulysses import learner_parallelism
from relay.learner.update import Learner
from relay.learner.weight_buckets import gather_buckets, plan_buckets
from relay.transport.messages import RolloutGroup

from ..conftest import exit_worker, free_port, gather_full_weights, save_random_model
from ..generators.test_vllm_engine import EOS, PROMPTS, needs_vllm
from ..generators.test_vllm_engine import start as start_vllm
from .test_memory_plan import TINY, eight_fake_ranks, storage_bytes  # noqa: F401 (a fixture)
from .test_memory_plan import run_config as plan_run_config
from .test_update import DATA, ROLLOUT, rollouts

RANK, ALPHA = 8, 16.0
SCALE = ALPHA / RANK
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_keys(path: Path, **keys: object) -> ModelConfig:
    return ModelConfig(path=str(path), lora_rank=RANK, lora_alpha=ALPHA, **keys)


def load_lora(path: Path, **keys: object) -> nn.Module:
    return load_sharded(str(path), compute_dtype=torch.float32, device=torch.device("cpu"),
                        lora=lora_keys(path, **keys))


def randomize_b(model: nn.Module, std: float = 0.05) -> None:
    """Fresh adapters have B = 0 (W' = W); give them a B to see them."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                (param.to_local() if isinstance(param, DTensor) else param).normal_(std=std)


def expected_merged(base_dir: Path, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + (alpha / r) B A from the base checkpoint and peft-named adapter tensors."""
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    out = {name: p.detach().clone() for name, p in base.named_parameters()}
    for name in out:
        stem = name.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{stem}.lora_A.weight")
        if a is not None:
            b = adapters[f"base_model.model.{stem}.lora_B.weight"]
            out[name] = out[name] + SCALE * b @ a
    return out


def published_version(model: nn.Module) -> dict[str, torch.Tensor]:
    """A publish of ``model`` (fp32 buckets of 16 KiB: tensors split across buckets),
    assembled whole by name on rank 0 ({} on the others); a collective."""
    plan = plan_buckets(model, torch.float32, 1 << 14)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for bucket in gather_buckets(model, plan, torch.float32, version=1):
        if bucket is None:
            continue
        for name, start, piece in zip(bucket.names, bucket.starts, bucket.tensors):
            pieces.setdefault(name, []).append((start, piece.clone()))
    return {n: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])])
            for n, p in pieces.items()}


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(
        random_model_dir: Path, one_rank_group) -> None:
    model = load_lora(random_model_dir)
    assert is_lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layers = model.config.num_hidden_layers
    assert len(trainable) == 2 * len(PROJECTIONS) * layers
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in held) == sum(p.numel() for n, p in model.named_parameters()
                                               if n in trainable)


def test_the_publish_sends_merged_weights_under_the_base_names(random_model_dir: Path,
                                                                one_rank_group) -> None:
    model = load_lora(random_model_dir)
    randomize_b(model)
    published = published_version(model)
    base = AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32)
    assert sorted(published) == sorted(n for n, _ in base.named_parameters())
    full = gather_full_weights(model, torch.float32)
    adapters = {n.replace(".default.", "."): t for n, t in full.items() if ".lora_" in n}
    expected = expected_merged(random_model_dir, adapters)
    merged = 0
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
        merged += not torch.equal(tensor, dict(base.named_parameters())[name])
    assert merged == len(PROJECTIONS) * base.config.num_hidden_layers


def test_a_target_module_the_model_lacks_is_refused_naming_the_key(random_model_dir: Path,
                                                                   one_rank_group) -> None:
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.target_modules.*"
                                         r"'qkv_proj'.*q_proj"):
        load_lora(random_model_dir, target_modules=["qkv_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"target_modules"):
        load_lora(random_model_dir, target_modules="nothing_matches_this")


def test_the_reference_is_the_base_with_its_adapters_disabled(random_model_dir: Path,
                                                               one_rank_group) -> None:
    model = load_lora(random_model_dir)
    randomize_b(model)
    base = load_sharded(str(random_model_dir), compute_dtype=torch.float32,
                        device=torch.device("cpu"), trainable=False)
    engine_batch = collate(rollouts_for(random_model_dir), pad_id=0)
    with torch.no_grad():
        with adapters_disabled(model):
            disabled, _ = forward_logprobs(model, engine_batch, 1.0, False)
        adapted, _ = forward_logprobs(model, engine_batch, 1.0, False)
        plain, _ = forward_logprobs(base, engine_batch, 1.0, False)
    torch.testing.assert_close(disabled, plain, rtol=0, atol=1e-6)
    assert not torch.allclose(adapted, plain, atol=1e-4)
    learner = lora_learner(model, reference=True)
    assert learner.reference is learner.model


def rollouts_for(model_dir: Path) -> list[RolloutGroup]:
    engine = TorchEngine.from_pretrained(str(model_dir), dtype=torch.float32, eos_ids=[-1],
                                         pad_id=0, seed=0)
    return rollouts(engine, 0)


def lora_learner(model: nn.Module, reference: bool) -> Learner:
    actor = ActorConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.0), use_kl_loss=reference)
    optimizer = build_optimizer(model, actor.optim)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10,
                                                     optim=actor.optim),
                   actor=actor, algorithm=AlgorithmConfig(), rollout=ROLLOUT, data=DATA,
                   reference=model if reference else None)


def test_gradient_checkpointing_gives_the_adapters_the_same_gradients(
        random_model_dir: Path, one_rank_group) -> None:
    batch = collate(rollouts_for(random_model_dir), pad_id=0)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(2)
        model = load_sharded(str(random_model_dir), compute_dtype=torch.float32,
                             device=torch.device("cpu"), gradient_checkpointing=checkpointing,
                             lora=lora_keys(random_model_dir))
        assert model.get_base_model().is_gradient_checkpointing == checkpointing
        randomize_b(model)
        model.train()
        logprobs, _ = forward_logprobs(model, batch, 1.0, False)
        (logprobs * batch.response_mask).sum().backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()
                      if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(".lora_" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_adapters_save_in_peft_format_and_merge(random_model_dir: Path, tmp_path: Path,
                                                one_rank_group) -> None:
    model = load_lora(random_model_dir)
    randomize_b(model)
    save_adapter(model, tmp_path / "adapter", base_path=str(random_model_dir))
    assert (tmp_path / "adapter" / ADAPTER_CONFIG).is_file()
    saved = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32),
        str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = loaded(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    write_merged(tmp_path / "adapter", tmp_path / "merged", torch.float32)
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    expected = expected_merged(random_model_dir, saved)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)


def test_lora_adapter_path_starts_from_a_saved_adapter_of_its_rank(
        random_model_dir: Path, tmp_path: Path, one_rank_group) -> None:
    model = load_lora(random_model_dir)
    randomize_b(model)
    save_adapter(model, tmp_path / "adapter", base_path=str(random_model_dir))
    saved = published_version(model)
    torch.manual_seed(9)  # fresh adapters would differ
    started = load_lora(random_model_dir, lora_adapter_path=str(tmp_path / "adapter"))
    assert all(p.requires_grad == (".lora_" in n) for n, p in started.named_parameters())
    for name, tensor in published_version(started).items():
        assert torch.equal(tensor, saved[name]), name
    with pytest.raises(ValueError, match=r"lora_adapter_path.*has rank 8.*lora_rank is 4"):
        load_sharded(str(random_model_dir), compute_dtype=torch.float32,
                     device=torch.device("cpu"),
                     lora=ModelConfig(path=str(random_model_dir), lora_rank=4,
                                      lora_adapter_path=str(tmp_path / "adapter")))


# -- two ranks ------------------------------------------------------------------------------


def train_lora_ranks(rank: int, world: int, port: int, model_dir: str, batch_file: str,
                     out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        model = load_lora(Path(model_dir))
        before = {n: t.clone() for n, t in gather_full_weights(model, torch.float32).items()
                  if ".lora_" not in n}
        learner = lora_learner(model, reference=True)
        metrics = [learner.step(batch, version=v).metrics for v in range(3)]
        after = gather_full_weights(model, torch.float32)
        published = published_version(model)
        save_hf(model, Path(out) / "hf", torch.float32)
        save_adapter(model, Path(out) / "adapter", base_path=model_dir)
        if rank == 0:
            torch.save({"before": before, "after": after, "published": published,
                        "kl": [m["actor/kl"] for m in metrics]}, Path(out) / "state.pt")
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow  # 2 processes training 3 steps: 21 s alone, 46 s on a busy 2-core machine
def test_two_ranks_train_lora_leaving_the_base_and_publishing_merged(
        random_model_dir: Path, tmp_path: Path) -> None:
    batch = collate(rollouts_for(random_model_dir), pad_id=0)
    torch.save(batch, tmp_path / "batch.pt")
    mp.start_processes(train_lora_ranks, args=(2, free_port(), str(random_model_dir),
                                               str(tmp_path / "batch.pt"), str(tmp_path)),
                       nprocs=2, start_method="spawn")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    after = state["after"]
    for name, tensor in state["before"].items():
        assert torch.equal(after[name], tensor), name  # the base weights, bitwise
    # the reference is the base: KL 0 while B = 0 (the first step's passes), then not
    assert state["kl"][0] == 0 and state["kl"][-1] > 0
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in after.items()
               if "lora_B" in n)  # the adapters trained
    adapters = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    expected = expected_merged(random_model_dir, adapters)
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(expected)
    write_merged(tmp_path / "adapter", tmp_path / "merged", torch.float32)
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    published = state["published"]
    for name, tensor in expected.items():
        for got in (exported[name], merged[name], published[name]):
            torch.testing.assert_close(got, tensor, rtol=0, atol=1e-6)
    # the lean engine, loaded with the base, takes the published version and generates as
    # the merged model does (greedy)
    engine = LeanEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                        eos_ids=[-1], pad_id=0, max_num_seqs=4, max_len=64)
    engine.load_weights(3, published)
    prompt = [1, 7, 4, 9]
    tokens = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                     dtype=torch.float32)
    greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None)[0, len(prompt):]
    assert tokens.token_ids.tolist() == greedy.tolist()


# -- checkpoints ----------------------------------------------------------------------------


def test_a_lora_checkpoint_holds_the_adapters_exports_merged_and_resumes(
        random_model_dir: Path, tmp_path: Path, one_rank_group) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise equal steps (tests/learner/test_checkpoint.py)
    try:
        batch = collate(rollouts_for(random_model_dir), pad_id=0)
        torch.manual_seed(3)
        trained = lora_learner(load_lora(random_model_dir), reference=True)
        for version in range(2):
            trained.step(batch, version=version)
        folder = save_checkpoint(trained, tmp_path, LoopState(step=2, version=2),
                                 lineage=Lineage(id="run"), keep_last=2,
                                 tokenizer=AutoTokenizer.from_pretrained(random_model_dir))
        uninterrupted = trained.step(batch, version=2)

        stored = FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata
        assert any(".lora_A." in key for key in stored)
        assert not any("base_layer" in key or "embed_tokens" in key for key in stored)
        adapters = load_file(str(folder / ADAPTER_FOLDER / ADAPTER_WEIGHTS))
        expected = expected_merged(random_model_dir, adapters)
        export(folder, tmp_path / "merged", dtype="float32", part="merged-lora")
        exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
        in_checkpoint = load_file(str(folder / "hf" / "model.safetensors"))
        assert sorted(exported) == sorted(in_checkpoint) == sorted(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6)
            torch.testing.assert_close(in_checkpoint[name], tensor, rtol=0, atol=1e-6)
        assert (tmp_path / "merged" / "tokenizer.json").is_file()

        torch.manual_seed(4)  # other fresh adapters, replaced by the checkpoint's
        resumed = lora_learner(load_lora(random_model_dir), reference=True)
        load_checkpoint(resumed, folder)
        again = resumed.step(batch, version=2)
        assert again.metrics == uninterrupted.metrics
        after = gather_full_weights(resumed.model, torch.float32)
        assert all(torch.equal(after[k], v) for k, v
                   in gather_full_weights(trained.model, torch.float32).items())
    finally:
        torch.set_num_threads(threads)


# -- Ulysses --------------------------------------------------------------------------------


def adapter_loss_and_grads(model: nn.Module, batch, sp) -> dict[str, torch.Tensor]:
    """The response log-probs' sum and its gradients on the adapters."""
    logprobs, _ = forward_logprobs(model, batch, 1.0, False, sp=sp)
    loss = (logprobs * batch.response_mask).sum()
    loss.backward()
    return {"loss": loss.detach(), "logprobs": logprobs.detach(),
            **{n: p.grad.detach().clone() for n, p in model.named_parameters()
               if p.requires_grad}}


def adapted_model(model_dir: Path) -> nn.Module:
    """The model as the learner loads it (relay attention), with seeded adapters, B != 0."""
    torch.manual_seed(5)
    model = wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                      attn_implementation=ATTENTION),
                 lora_keys(model_dir), load_adapter=False)
    randomize_b(model)
    return model


def lora_sp_worker(rank: int, world: int, port: int, model_dir: str, batch_file: str,
                   out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = torch.load(batch_file, weights_only=False)
        sp = learner_parallelism(torch.device("cpu"), world).sequence
        result = adapter_loss_and_grads(adapted_model(Path(model_dir)), batch, sp)
        for name in result:  # each rank holds its slice's share of the gradients
            if name not in ("loss", "logprobs"):
                dist.all_reduce(result[name], group=sp.group)
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_lora_under_ulysses_sp2_gives_the_adapter_gradients_of_one_process(
        random_model_dir: Path, tmp_path: Path) -> None:
    batch = collate(rollouts_for(random_model_dir), pad_id=0)
    torch.save(batch, tmp_path / "batch.pt")
    mp.start_processes(lora_sp_worker, args=(2, free_port(), str(random_model_dir),
                                             str(tmp_path / "batch.pt"), str(tmp_path / "sp.pt")),
                       nprocs=2, start_method="spawn")
    two = torch.load(tmp_path / "sp.pt", weights_only=False)
    one = adapter_loss_and_grads(adapted_model(random_model_dir), batch, sp=None)
    assert set(two) == set(one) and any("lora_A" in n for n in one)
    for name, expected in one.items():
        torch.testing.assert_close(two[name], expected, atol=2e-5, rtol=1e-4, msg=name)


# -- vLLM's CPU build -----------------------------------------------------------------------


@needs_vllm
def test_vllms_cpu_build_generates_with_the_published_merged_weights(tmp_path: Path) -> None:
    model_dir = save_random_model(tmp_path / "base", hidden=128)  # vLLM's CPU heads: >= 32
    # the learner's side in a process group of its own, gone before vLLM makes its own
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = load_lora(model_dir)
        randomize_b(model)
        published = published_version(model)
        save_adapter(model, tmp_path / "adapter", base_path=str(model_dir))
    finally:
        dist.destroy_process_group()
    write_merged(tmp_path / "adapter", tmp_path / "merged", torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    torch.save(published, tmp_path / "published.pt")
    # vLLM's engine core runs in its process and leaves a default process group behind: a
    # process of its own keeps it from the tests after this one
    mp.start_processes(vllm_generates, args=(str(model_dir), str(tmp_path)), nprocs=1,
                       start_method="spawn")
    completions = torch.load(tmp_path / "vllm.pt")
    for prompt, tokens in zip(PROMPTS, completions):
        with torch.no_grad():
            expected = merged.generate(torch.tensor([prompt]), max_new_tokens=8,
                                       do_sample=False, eos_token_id=EOS, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()[:len(tokens)]


def vllm_generates(_index: int, model_dir: str, folder: str) -> None:
    """vLLM's CPU engine on ``model_dir`` loads ``folder/published.pt`` and writes its greedy
    completions of ``PROMPTS`` to ``folder/vllm.pt``."""
    engine = start_vllm(Path(model_dir))
    engine.load_weights(1, torch.load(Path(folder) / "published.pt"))
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    torch.save([c.token_ids.tolist() for c in completions], Path(folder) / "vllm.pt")
    exit_worker()


# -- the memory plan ------------------------------------------------------------------------


def test_the_memory_plan_holds_a_lora_policys_trained_state_and_no_reference(
        eight_fake_ranks: None) -> None:
    config = Qwen2Config(**TINY)
    keys = ModelConfig(path="unused", lora_rank=RANK, lora_alpha=ALPHA)
    run = plan_run_config(model=keys, actor=ActorConfig(use_kl_loss=True))
    models = LearnerModels(policy=count_parameters(config), adapters=count_adapters(config, run))
    model = wrap(AutoModelForCausalLM.from_config(config), keys, load_adapter=False)
    shard(model, compute_dtype=torch.bfloat16, blocks=block_classes(model))
    optimizer = build_optimizer(model, run.actor.optim)
    ids = torch.randint(0, 509, (1, 32))
    logprobs, _ = position_logprobs(model, {"input_ids": ids}, torch.arange(31), ids[0, 1:],
                                    1.0, with_entropy=False)
    logprobs.sum().backward()
    optimizer.step()
    planned = {item.name: item.bytes for item in plan_learner(run, models, ranks=8).items}
    assert storage_bytes(p.to_local() for p in model.parameters()) \
        == planned["policy parameter shards (fp32)"]
    assert storage_bytes(p.grad.to_local() for p in model.parameters() if p.grad is not None) \
        == planned["policy gradient shards (fp32)"]
    states = [v.to_local() if hasattr(v, "to_local") else v
              for state in optimizer.state.values() for v in state.values()]
    assert storage_bytes(iter(states)) == planned["policy AdamW states (2 x fp32)"]
    full = {item.name: item.bytes for item in plan_learner(
        plan_run_config(actor=ActorConfig(use_kl_loss=True)), LearnerModels(
            policy=models.policy), ranks=8).items}
    assert planned["policy AdamW states (2 x fp32)"] < full["policy AdamW states (2 x fp32)"] / 4
    assert "reference parameter shards" in full and "reference parameter shards" not in planned
