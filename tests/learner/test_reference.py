"""The reference model's log-prob passes follow ``ref.*`` (verl's ``actor_rollout_ref.ref``),
and fall back to the actor's cut where ``ref`` leaves a key unset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relay.configs.run_schema import ActorConfig, AlgorithmConfig, OptimConfig, RefConfig
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import collate
from relay.learner.model import load_sharded
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.update import Learner

from .test_update import DATA, N, PROMPTS, ROLLOUT, rollouts


def build(path: Path, ref: RefConfig) -> Learner:
    optim = OptimConfig(lr=1e-3)
    actor = ActorConfig(use_kl_loss=True, share_prompts=False, optim=optim)
    load = dict(compute_dtype=torch.float32, device=torch.device("cpu"))
    model = load_sharded(str(path), **load)
    reference = load_sharded(str(path), trainable=False, **load)
    optimizer = build_optimizer(model, optim)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10, optim=optim),
                   actor=actor, algorithm=AlgorithmConfig(), ref=ref, rollout=ROLLOUT,
                   data=DATA, reference=reference)


@pytest.mark.usefixtures("one_rank_group")
def test_reference_passes_are_cut_by_the_ref_section(random_model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=1)
    batch = collate(rollouts(engine, 1), pad_id=0)
    passes: list[int] = []

    def logprobs(ref: RefConfig) -> torch.Tensor:
        learner = build(random_model_dir, ref)
        assert learner.reference is not None
        body = learner.reference.get_decoder()  # a pass runs the body, then the head
        hook = body.register_forward_hook(lambda *_: passes.append(1))
        try:
            return learner._no_grad_logprobs(learner.reference, batch, learner.ref_micro)
        finally:
            hook.remove()

    actors_cut = logprobs(RefConfig())  # unset: the actor's 64 rows a pass, one pass
    assert len(passes) == 1
    passes.clear()
    one_row = logprobs(RefConfig(log_prob_micro_batch_size_per_gpu=1))
    assert len(passes) == len(PROMPTS) * N
    passes.clear()
    budget = logprobs(RefConfig(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=1))
    assert len(passes) == len(PROMPTS) * N  # a row longer than the budget: a pass of its own
    mask = batch.response_mask.bool()  # padding positions hold whatever a pass left there
    torch.testing.assert_close(one_row[mask], actors_cut[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(budget[mask], actors_cut[mask], atol=1e-5, rtol=1e-5)


def test_unset_ref_keys_take_the_actors_values() -> None:
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=True,
                        ppo_max_token_len_per_gpu=999)
    resolved = RefConfig(log_prob_micro_batch_size_per_gpu=16).resolve(actor)
    assert resolved.log_prob_micro_batch_size_per_gpu == 16
    assert resolved.log_prob_use_dynamic_bsz is True
    assert resolved.log_prob_max_token_len_per_gpu == 999
    assert resolved.ulysses_sequence_parallel_size == 1
    assert resolved.fsdp_config.param_offload is False
