"""relay.learner.memory_plan: Qwen2.5-7B and -32B counted on the meta device (no weights), and the
plan's formulas against what torch measures on the CPU: autograd's saved tensors per block
and token, a rank's real shards, gradients and AdamW states at 8 ranks (torch's fake
process group: real allocations, no communication), a real FSDP2 pass under torch's
``MemTracker``, and whole logits' log-probs and entropies under it."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from relay.algorithms.logprobs import entropy_from_logits, token_logprobs
from relay.configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    FsdpConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
)
from relay.learner.logprob_head import position_logprobs
from relay.learner.memory_plan import (
    CUDA_RUNTIME_BYTES,
    HELD,
    BlockShape,
    LearnerModels,
    activation_bytes,
    count_parameters,
    pass_tokens,
    plan_learner,
    saved_bytes_per_token,
    surrounding_bytes_per_token,
    unchunked_logits_bytes,
    update_phases,
)
from relay.learner.model import block_classes, enable_activation_checkpointing, shard
from relay.learner.optim import build_optimizer

from ..qwen25_configs import QWEN25_7B, QWEN25_32B, qwen2_parameters

GIB = 1 << 30
TINY = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=509, max_position_embeddings=4096,
            tie_word_embeddings=False, attn_implementation="sdpa")  # dims 8 does not divide


def qwen(config: dict) -> Qwen2Config:
    return AutoConfig.for_model(**config)


def run_config(**sections: object) -> RunConfig:
    """A run config for a plan: the schema's defaults and ``sections``."""
    return RunConfig(data=sections.pop("data", DataConfig(train_files="unused")),
                     model=sections.pop("model", ModelConfig(path="unused")), **sections)


@pytest.mark.parametrize("config, parameters", [(QWEN25_7B, 7_615_616_512),
                                                (QWEN25_32B, 32_763_876_352)])
def test_qwen25_parameters_counted_on_the_meta_device_match_the_architecture(
        config: dict, parameters: int) -> None:
    size = count_parameters(qwen(config))
    h, vocab = config["hidden_size"], config["vocab_size"]
    assert size.numel == qwen2_parameters(config) == parameters
    assert size.root == 2 * vocab * h + h and size.head == vocab * h  # untied head
    assert size.block == (size.numel - size.root) // config["num_hidden_layers"]
    assert size.head_kind == "chunked"
    assert size.shard_numel(8) * 8 == size.numel  # every dimension divides by 8


def test_shards_are_padded_as_fsdp2_pads_them() -> None:
    size = count_parameters(Qwen2Config(**TINY))
    by_hand = sum(-(-length // 8) * per_row for length, per_row in size.rows)
    assert size.shard_numel(8) == by_hand > size.numel / 8


@pytest.mark.parametrize("family", [Qwen2Config, LlamaConfig, Qwen3Config])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_saved_tensors_of_a_block_per_token_are_the_formula(family: type, dtype: torch.dtype
                                                            ) -> None:
    def saved(layers: int, checkpointing: bool) -> int:
        torch.manual_seed(0)
        config = family(**{**TINY, "num_hidden_layers": layers, "head_dim": 24})
        model = AutoModelForCausalLM.from_config(config).to(dtype)
        if checkpointing:
            enable_activation_checkpointing(model)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.model(input_ids=torch.randint(0, 509, (1, tokens)), use_cache=False)
        return sum(storages.values())

    tokens, c = 64, dtype.itemsize
    shape = BlockShape.of(family(**{**TINY, "head_dim": 24}))
    assert (saved(2, False) - saved(1, False)) / tokens == saved_bytes_per_token(shape, c)
    assert (saved(2, True) - saved(1, True)) / tokens == c * shape.hidden  # the block's input


@pytest.fixture
def eight_fake_ranks() -> Iterator[None]:
    """torch's fake process group of 8 ranks in this process: FSDP2 allocates as rank 0 of
    8 does, and no collective moves data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (FSDP2's gradients are views of one
    buffer per block)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_a_ranks_shards_gradients_and_adamw_states_at_8_ranks_are_the_plans(
        eight_fake_ranks: None) -> None:
    config = Qwen2Config(**TINY)
    size = count_parameters(config)
    model = AutoModelForCausalLM.from_config(config)
    shard(model, compute_dtype=torch.bfloat16, blocks=block_classes(model))
    optimizer = build_optimizer(model, run_config().actor.optim)
    ids = torch.randint(0, 509, (1, 32))
    logprobs, _ = position_logprobs(model, {"input_ids": ids}, torch.arange(31), ids[0, 1:],
                                    1.0, with_entropy=False)
    logprobs.sum().backward()
    optimizer.step()
    plan = plan_learner(run_config(), LearnerModels(policy=size), ranks=8)
    planned = {item.name: item.bytes for item in plan.items}
    assert storage_bytes(p.to_local() for p in model.parameters()) \
        == planned["policy parameter shards (fp32)"] == 4 * size.shard_numel(8)
    assert storage_bytes(p.grad.to_local() for p in model.parameters()) \
        == planned["policy gradient shards (fp32)"]
    states = [v.to_local() if hasattr(v, "to_local") else v
              for state in optimizer.state.values() for v in state.values()]
    assert storage_bytes(iter(states)) == planned["policy AdamW states (2 x fp32)"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_real_fsdp2_pass_peaks_within_the_plan(one_rank_group: None,
                                                 checkpointing: bool) -> None:
    tokens = 1024
    config = Qwen2Config(**{**TINY, "hidden_size": 256, "intermediate_size": 704,
                            "num_attention_heads": 8, "num_hidden_layers": 4})
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing:
        enable_activation_checkpointing(model)
    shard(model, compute_dtype=torch.bfloat16, blocks=block_classes(model))
    optimizer = build_optimizer(model, run_config().actor.optim)
    ids = torch.randint(0, 509, (1, tokens))

    def update_pass() -> None:
        logprobs, entropy = position_logprobs(model, {"input_ids": ids},
                                              torch.arange(tokens - 1), ids[0, 1:], 1.0, True)
        (logprobs.sum() + entropy.sum()).backward()

    update_pass()
    optimizer.step()  # AdamW's states exist from here on
    update_pass()  # a second micro-batch's backward starts with gradients accumulated
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        update_pass()
    [measured] = tracker.get_tracker_snapshot("peak").values()
    run = run_config(model=ModelConfig(path="unused", enable_gradient_checkpointing=checkpointing),
                     data=DataConfig(train_files="unused", train_batch_size=1,
                                     max_prompt_length=tokens // 2),
                     rollout=RolloutConfig(n=1, response_length=tokens // 2),
                     actor=ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=tokens))
    plan = plan_learner(run, LearnerModels(policy=count_parameters(config)), ranks=1)
    phases = plan.phase_bytes()
    on_the_cpu = phases[HELD] - CUDA_RUNTIME_BYTES - tokens * 48  # no CUDA context; the batch
    planned = on_the_cpu + phases[update_phases("policy")[0]]
    total = measured["Total"]
    assert total <= planned <= 1.5 * total, (total, planned)
    if not checkpointing:  # the peak is the backward's start: every activation kept
        shape = BlockShape.of(config)
        kept = tokens * (shape.layers * saved_bytes_per_token(shape, 2)
                         + surrounding_bytes_per_token(shape, 2))
        activations = next(v for k, v in measured.items() if str(k).endswith("ACT"))
        assert activations == pytest.approx(kept, rel=0.02)


def test_whole_logits_log_probs_and_entropies_take_what_the_plan_says() -> None:
    positions, vocab = 256, 4096
    logits = torch.randn(positions, vocab, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, vocab, (positions,))
    tracker = MemTracker()
    with tracker:
        loss = token_logprobs(logits, tokens).sum() + entropy_from_logits(logits).sum()
        loss.backward()
    [measured] = tracker.get_tracker_snapshot("peak").values()
    shape = BlockShape.of(Qwen2Config(**{**TINY, "vocab_size": vocab}))
    assert measured["Total"] + logits.nbytes == pytest.approx(
        unchunked_logits_bytes(shape, positions, 2), rel=0.01)


def test_the_update_pass_holds_the_token_budget_or_the_micro_batch() -> None:
    budget = dict(use_dynamic_bsz=True, max_token_len=16384, micro_batch_size=8)
    assert pass_tokens(**budget, row_length=5120, sp=1) == 16384
    assert pass_tokens(**budget, row_length=40960, sp=2) == 20480  # a longer row, split
    assert pass_tokens(use_dynamic_bsz=False, max_token_len=16384, micro_batch_size=8,
                       row_length=5120, sp=4) == 8 * 5120 // 4


@pytest.fixture(scope="module")
def qwen7b() -> LearnerModels:
    return LearnerModels(policy=count_parameters(qwen(QWEN25_7B)))


def planned(plan, name: str) -> int:  # noqa: ANN001 - a MemoryPlan
    return next(item.bytes for item in plan.items if item.name == name)


def test_7b_at_8_ranks_holds_its_fp32_shards_and_adamw_states(qwen7b: LearnerModels) -> None:
    plan = plan_learner(run_config(), qwen7b, ranks=8)
    shard = qwen7b.policy.numel // 8
    assert planned(plan, "policy parameter shards (fp32)") == 4 * shard
    assert planned(plan, "policy AdamW states (2 x fp32)") == 8 * shard + 4 * 339  # tensors
    totals = plan.phase_bytes()
    assert plan.peak == totals[HELD] + max(v for k, v in totals.items() if k != HELD)


def test_offloading_takes_the_states_off_the_gpu(qwen7b: LearnerModels) -> None:
    def actor(**fsdp: bool) -> ActorConfig:
        return ActorConfig(fsdp_config=FsdpConfig(**fsdp))

    kept = plan_learner(run_config(), qwen7b, ranks=8)
    params = plan_learner(run_config(actor=actor(param_offload=True)), qwen7b, ranks=8)
    states = plan_learner(run_config(actor=actor(optimizer_offload=True)), qwen7b, ranks=8)
    for name in ("policy parameter shards (fp32)", "policy AdamW states (2 x fp32)",
                 "policy gradient shards (fp32)"):
        assert planned(params, name) == 0
    assert planned(params, "policy gathered blocks") == planned(kept, "policy gathered blocks")
    assert planned(states, "policy AdamW states (2 x fp32)") == 0
    brought = next(i for i in states.items if i.name.endswith("brought for the step"))
    assert brought.bytes == planned(kept, "policy AdamW states (2 x fp32)")
    assert brought.phases == (update_phases("policy")[2],)


def test_kl_holds_a_bf16_reference_and_fsdp_size_shards_over_fewer_ranks(
        qwen7b: LearnerModels) -> None:
    numel = qwen7b.policy.numel
    with_kl = plan_learner(run_config(actor=ActorConfig(use_kl_loss=True)), qwen7b, ranks=8)
    assert planned(with_kl, "reference parameter shards") == 2 * numel // 8
    hybrid = plan_learner(run_config(actor=ActorConfig(fsdp_config=FsdpConfig(fsdp_size=4))),
                          qwen7b, ranks=8)
    assert planned(hybrid, "policy parameter shards (fp32)") == 4 * numel // 4
    with pytest.raises(ValueError, match="actor.fsdp_config.fsdp_size = 3"):
        plan_learner(run_config(actor=ActorConfig(fsdp_config=FsdpConfig(fsdp_size=3))),
                     qwen7b, ranks=8)


def test_gae_adds_a_critic_trained_in_phases_of_its_own(qwen7b: LearnerModels) -> None:
    config = qwen(QWEN25_7B)
    critic = count_parameters(config, value_head=True)
    h, vocab = QWEN25_7B["hidden_size"], QWEN25_7B["vocab_size"]
    assert critic.numel == qwen7b.policy.numel - vocab * h + h + 1  # a value head, no LM head
    models = msgspec.structs.replace(qwen7b, critic=critic)
    plan = plan_learner(run_config(algorithm=AlgorithmConfig(adv_estimator="gae")), models,
                        ranks=8)
    assert planned(plan, "critic parameter shards (fp32)") == 4 * critic.shard_numel(8)
    assert set(update_phases("critic")) <= set(plan.phase_bytes())


def test_checkpointing_keeps_one_input_a_block(qwen7b: LearnerModels) -> None:
    tokens, shape = 16384, qwen7b.policy.shape
    whole = activation_bytes(shape, tokens, 2, checkpointing=False)
    checkpointed = activation_bytes(shape, tokens, 2, checkpointing=True)
    per_block = saved_bytes_per_token(shape, 2)
    assert whole - checkpointed == tokens * (shape.layers - 1) * per_block \
        - tokens * shape.layers * 2 * shape.hidden
    assert whole / GIB > 80 > checkpointed / GIB  # 7B at 16k tokens needs checkpointing
