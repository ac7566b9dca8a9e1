"""eta = 0 reproduces synchronous on-policy GRPO.

The learner (FSDP2 over a real gloo process group, the staleness-corrected loss) and a
plain single-process GRPO written out below train on the very same on-policy rollouts for
a few steps; their losses and parameters must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relay.configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    FsdpConfig,
    OptimConfig,
    RolloutConfig,
)
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import TrainBatch, collate
from relay.learner.model import load_sharded
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.update import Learner
from relay.transport.messages import RolloutGroup, Sample

from ..conftest import gather_full_weights

PROMPTS = [[1, 271, 201, 273, 272, 223, 19, 20, 280, 2, 201, 1, 278, 201],
           [1, 271, 201, 273, 21, 22, 2, 201, 1, 278, 201],
           [1, 271, 201, 24, 25, 26, 27, 2, 201, 1, 278, 201]]
N = 4
LR = 1e-3
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
ROLLOUT = RolloutConfig(temperature=1.0, response_length=6)  # the rollouts below: 6 tokens
DATA = DataConfig(train_files=[], train_batch_size=len(PROMPTS))  # one batch: PROMPTS


def synthetic_reward(response: torch.Tensor) -> float:
    """Any deterministic function of the response with spread inside a group will do."""
    return float(int(response[0]) % 2)


def rollouts(engine: TorchEngine, step: int) -> list[RolloutGroup]:
    completions = engine.generate([p for p in PROMPTS for _ in range(N)],
                                  SamplingParams(max_new_tokens=6, temperature=1.0))
    groups = []
    for index, prompt in enumerate(PROMPTS):
        samples = [Sample(prompt_ids=torch.tensor(prompt, dtype=torch.int32),
                          response_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                          reward=synthetic_reward(c.token_ids))
                   for c in completions[index * N:(index + 1) * N]]
        groups.append(RolloutGroup(rollout_id=f"{step}/{index}", lease_id=str(step),
                                   prompt_id=str(index), generator_id="g", samples=samples))
    return groups


def reference_grpo_step(model, optimizer, batch: TrainBatch) -> float:
    """Plain synchronous GRPO: old log-probs = current ones, token-mean clipped surrogate."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    rewards, groups = batch.rewards, batch.group_ids
    advantages = torch.zeros_like(rewards)
    for g in groups.unique():
        members = groups == g
        r = rewards[members]
        advantages[members] = (r - r.mean()) / (r.std() + 1e-6)
    adv = advantages[:, None]
    ratio = torch.exp(logp - logp.detach())
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    mask = batch.response_mask
    loss = (per_token * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def build_learner(path: Path, gradient_checkpointing: bool = False,
                  **actor_overrides) -> Learner:
    optim = OptimConfig(lr=LR, weight_decay=0.0)
    actor = ActorConfig(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, optim=optim,
                        **actor_overrides)
    model = load_sharded(str(path), compute_dtype=torch.float32, device=torch.device("cpu"),
                         gradient_checkpointing=gradient_checkpointing,
                         offload=actor.fsdp_config.param_offload,
                         compile_blocks=actor.use_torch_compile)
    optimizer = build_optimizer(model, optim)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10, optim=optim),
                   actor=actor, algorithm=AlgorithmConfig(), rollout=ROLLOUT, data=DATA)


@pytest.mark.usefixtures("one_rank_group")
def test_eta_zero_matches_plain_synchronous_grpo(random_model_dir: Path) -> None:
    torch.manual_seed(0)
    learner = build_learner(random_model_dir)
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32, eos_ids=[2],
                                         pad_id=0, seed=1)
    reference = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for step in range(1, 4):
        batch = collate(rollouts(engine, step), pad_id=0)
        assert batch.rewards.std() > 0, "the test needs reward spread to move the weights"
        metrics = learner.step(batch).metrics
        ref_loss = reference_grpo_step(reference, ref_optim, batch)
        assert metrics["actor/loss"] == pytest.approx(ref_loss, abs=1e-5)
        assert metrics["actor/importance_weight_max"] == pytest.approx(1.0, abs=1e-4)
        full = gather_full_weights(learner.model, torch.float32)
        for name, ref_param in reference.named_parameters():
            torch.testing.assert_close(full[name], ref_param.detach(), atol=2e-5, rtol=1e-4)
        engine.load_weights(step, full)  # publish: the next rollouts are on-policy again
    moved = max(float((full[n] - initial[n]).abs().max()) for n in initial)
    assert moved > 10 * LR / 10, "the parameters must have changed"


def first_moments(learner: Learner) -> list[torch.Tensor]:
    """Adam's exp_avg of every parameter, whole (FSDP2 holds them as DTensors)."""
    return [learner.optimizer.state[p]["exp_avg"].full_tensor().clone()
            for p in learner.model.parameters()]


@pytest.mark.usefixtures("one_rank_group")
def test_micro_batches_do_not_change_the_update(random_model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32, eos_ids=[2],
                                         pad_id=0, seed=2)
    batch = collate(rollouts(engine, 1), pad_id=0)
    results = []
    cuts = (dict(ppo_micro_batch_size_per_gpu=64), dict(ppo_micro_batch_size_per_gpu=5),
            dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60))
    for cut in cuts:
        torch.manual_seed(0)
        learner = build_learner(random_model_dir, **cut, loss_agg_mode="seq-mean-token-mean")
        metrics = learner.step(batch).metrics
        results.append((metrics["actor/loss"], first_moments(learner)))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    assert results[0][0] == pytest.approx(results[2][0], abs=1e-6)
    # Compare the gradients (Adam's first moment after one step is (1 - beta1) * g), not the
    # weights: Adam's first step moves each weight by about lr * g / |g|, which turns float
    # summation-order noise in a near-zero gradient into a full lr-sized difference.
    scale = max(float(m.abs().max()) for m in results[0][1])
    for other in results[1:]:
        for mine, theirs in zip(results[0][1], other[1], strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.usefixtures("one_rank_group")
def test_skipping_rows_without_advantage_does_not_change_the_update(
        random_model_dir: Path) -> None:
    """A group whose samples all scored the same has zero advantages: its rows get no pass
    but still count in token-mean's denominator, so loss and gradients are unchanged."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32, eos_ids=[2],
                                         pad_id=0, seed=2)
    batch = collate(rollouts(engine, 1), pad_id=0)
    batch.rewards[batch.group_ids == batch.group_ids[0]] = 1.0
    results = []
    for skip in (False, True):
        torch.manual_seed(0)
        learner = build_learner(random_model_dir, skip_zero_advantage=skip)
        metrics = learner.step(batch).metrics
        results.append((metrics, first_moments(learner)))
    (plain, plain_moments), (skipping, skipping_moments) = results
    assert plain["actor/zero_advantage_rows_skipped"] == 0
    assert skipping["actor/zero_advantage_rows_skipped"] >= N
    assert skipping["actor/loss"] == pytest.approx(plain["actor/loss"], abs=1e-6)
    scale = max(float(m.abs().max()) for m in plain_moments)
    for mine, theirs in zip(plain_moments, skipping_moments, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.usefixtures("one_rank_group")
def test_sharing_prompts_does_not_change_the_update(random_model_dir: Path) -> None:
    """One sequence per prompt group (the prompt computed once) gives the loss and gradients
    of one row per sample, whole groups in a pass or split across passes."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32, eos_ids=[2],
                                         pad_id=0, seed=3)
    batch = collate(rollouts(engine, 1), pad_id=0)
    results = []
    cuts = (dict(share_prompts=False), dict(share_prompts=True),
            dict(share_prompts=True, ppo_micro_batch_size_per_gpu=3),
            dict(share_prompts=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40))
    for cut in cuts:
        torch.manual_seed(0)
        learner = build_learner(random_model_dir, **cut)
        metrics = learner.step(batch).metrics
        results.append((metrics, first_moments(learner)))
    rows, rows_moments = results[0]
    scale = max(float(m.abs().max()) for m in rows_moments)
    for metrics, moments in results[1:]:
        assert metrics["actor/loss"] == pytest.approx(rows["actor/loss"], abs=1e-6)
        assert metrics["actor/entropy"] == pytest.approx(rows["actor/entropy"], abs=1e-5)
        for mine, theirs in zip(rows_moments, moments, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.usefixtures("one_rank_group")
def test_memory_knobs_do_not_change_the_update(random_model_dir: Path) -> None:
    """model.enable_gradient_checkpointing, actor.fsdp_config.param_offload (FSDP2's
    CPUOffloadPolicy) and optimizer_offload trade time for memory, never the update."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32, eos_ids=[2],
                                         pad_id=0, seed=4)
    batches = [collate(rollouts(engine, step), pad_id=0) for step in (1, 2)]
    knobs = {"none": {}, "checkpointing": dict(gradient_checkpointing=True),
             "param offload": dict(fsdp_config=FsdpConfig(param_offload=True)),
             "optimizer offload": dict(fsdp_config=FsdpConfig(optimizer_offload=True))}
    results = {}
    for name, knob in knobs.items():
        torch.manual_seed(0)
        learner = build_learner(random_model_dir, **knob)
        losses = [learner.step(batch).metrics["actor/loss"] for batch in batches]
        results[name] = (losses, gather_full_weights(learner.model, torch.float32))
        if name == "checkpointing":
            assert any(getattr(m, "gradient_checkpointing", False)
                       for m in learner.model.modules())
    plain_losses, plain_weights = results.pop("none")
    for name, (losses, weights) in results.items():
        assert losses == pytest.approx(plain_losses, abs=1e-6), name
        for key, tensor in plain_weights.items():
            torch.testing.assert_close(weights[key], tensor, atol=LR / 5, rtol=1e-4,
                                       msg=f"{name}: {key}")


@pytest.mark.usefixtures("one_rank_group")
def test_compiling_norms_and_mlps_does_not_change_the_update(random_model_dir: Path) -> None:
    """actor.use_torch_compile compiles each block's norms and MLP (dynamic shapes: the two
    steps' batches differ in length), in row and shared-prompt passes, never the attention;
    the losses and weights are eager's to float rounding."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32, eos_ids=[2],
                                         pad_id=0, seed=5)
    batches = [collate(rollouts(engine, 1), pad_id=0), collate(rollouts(engine, 2)[1:], pad_id=0)]
    assert batches[0].input_ids.shape != batches[1].input_ids.shape
    for share_prompts in (False, True):
        results = {}
        for compiled in (False, True):
            torch.manual_seed(0)
            learner = build_learner(random_model_dir, use_torch_compile=compiled,
                                    share_prompts=share_prompts)
            losses = [learner.step(batch).metrics["actor/loss"] for batch in batches]
            results[compiled] = (losses, gather_full_weights(learner.model, torch.float32))
        layer = learner.model.model.layers[0]
        assert hasattr(layer.mlp, "_compiled_call_impl") and layer.mlp._compiled_call_impl
        assert layer.input_layernorm._compiled_call_impl
        assert getattr(layer.self_attn, "_compiled_call_impl", None) is None
        assert results[True][0] == pytest.approx(results[False][0], abs=1e-5)
        for key, tensor in results[False][1].items():
            torch.testing.assert_close(results[True][1][key], tensor, atol=LR / 5, rtol=1e-4,
                                       msg=key)
