"""algorithms/ computes on the device of its inputs: given CUDA tensors, every pure function
returns CUDA tensors equal to its CPU results, and never puts a CPU tensor beside them.

Checked on the CPU two ways (issue 29's harness):

- ``tests.fake_cuda``: real values on a simulated ``cuda:0`` with CUDA's device rules, for
  every function (the group statistics of the advantages, M2PO and clip_cov read their
  inputs on the host, which fake tensors cannot);
- torch's ``FakeTensorMode`` with fake ``cuda`` tensors (``FakeTensorDeviceMismatchError``
  on a mismatch) for the functions that never read a value on the host: the per-token
  ones.
"""

from __future__ import annotations

import dataclasses
import functools

import msgspec
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from relay.algorithms.advantages import ESTIMATORS, AdvantageInputs, compute_advantages, gae_advantages
from relay.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from relay.algorithms.kl import KLType, kl_penalty, kl_reward_penalty
from relay.algorithms.logprobs import entropy_from_logits, token_logprobs
from relay.algorithms.off_policy import (
    RolloutCorrectionConfig,
    a3po_proximal_logprobs,
    off_policy_correction,
)
from relay.algorithms.policy_loss import LOSS_MODES, PolicyLossConfig, policy_loss
from relay.algorithms.prime import implicit_process_rewards, implicit_prm_loss, prime_advantages
from relay.algorithms.value_loss import clipped_value_loss

from ..fake_cuda import CudaTensor, fake_cuda, on_cuda

B, T, V = 6, 5, 11
KL_TYPES = KLType.__args__  # type: ignore[attr-defined]


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of 2 groups of 3 rows, responses of 2..5 tokens, rewards with spread."""
    generator = torch.Generator().manual_seed(seed)

    def logprobs() -> torch.Tensor:
        return -torch.rand(B, T, generator=generator) * 3

    lengths = torch.tensor([5, 2, 4, 3, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return dict(logprobs=logprobs(), proximal=logprobs(), behavior=logprobs(),
                reference=logprobs(), mask=mask,
                rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
                group_ids=torch.tensor([3, 3, 3, 7, 7, 7]),
                values=torch.randn(B, T, generator=generator),
                token_rewards=torch.randn(B, T, generator=generator) * 0.1 * mask,
                kept=(torch.rand(B, T, generator=generator) > 0.2).float() * mask,
                versions=torch.randint(0, 3, (B, T), generator=generator),
                logits=torch.randn(B, T, V, generator=generator),
                tokens=torch.randint(0, V, (B, T), generator=generator))


def leaves(result: object) -> list[object]:
    """The tensors and numbers of a result (a tensor, tuple, msgspec struct, dataclass)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, msgspec.Struct):
        return [x for f in result.__struct_fields__ for x in leaves(getattr(result, f))]
    if dataclasses.is_dataclass(result):
        return [x for f in dataclasses.fields(result) for x in leaves(getattr(result, f.name))]
    if isinstance(result, (tuple, list)):
        return [x for item in result for x in leaves(item)]
    return [result]


def on_both(fn, tensors: dict[str, torch.Tensor], seed: int = 0) -> None:
    """``fn(**tensors)`` on the CPU and on fake CUDA: every tensor it returns on CUDA, with
    the CPU's values; numbers equal."""
    torch.manual_seed(seed)
    expected = leaves(fn(**tensors))
    torch.manual_seed(seed)
    with fake_cuda():
        got = leaves(fn(**{name: on_cuda(t) for name, t in tensors.items()}))
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        if isinstance(theirs, torch.Tensor):
            assert isinstance(mine, CudaTensor) and mine.device.type == "cuda"
            torch.testing.assert_close(mine.host, theirs, equal_nan=True)
        else:
            assert mine == pytest.approx(theirs)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_computes_on_the_device_of_its_inputs(estimator: str) -> None:
    x = inputs()

    def advantages(rewards, group_ids, mask, token_rewards, kept, baselines):
        return compute_advantages(estimator, AdvantageInputs(
            rewards=rewards, group_ids=group_ids, response_mask=mask,
            token_rewards=token_rewards, baseline_rewards=baselines, kept_mask=kept),
            norm_adv_by_std_in_grpo=True, gamma=0.99)

    on_both(advantages, dict(rewards=x["rewards"], group_ids=x["group_ids"], mask=x["mask"],
                             token_rewards=x["token_rewards"], kept=x["kept"],
                             baselines=x["rewards"] * 0.5))


def test_gae_computes_on_the_device_of_its_inputs() -> None:
    x = inputs()
    on_both(functools.partial(gae_advantages, gamma=0.99, lam=0.95),
            dict(token_rewards=x["token_rewards"], values=x["values"],
                 response_mask=x["mask"], kept_mask=x["kept"]))


@pytest.mark.parametrize("mode", sorted(LOSS_MODES))
def test_every_loss_mode_computes_on_the_device_of_its_inputs(mode: str) -> None:
    x = inputs()
    config = PolicyLossConfig(loss_mode=mode, clip_cov_ratio=0.3, kl_cov_ratio=0.3,
                              clip_cov_lb=-5.0)
    on_both(functools.partial(policy_loss, config=config, clip_ratio_low=0.2,
                              clip_ratio_high=0.28, clip_ratio_c=3.0),
            dict(logprobs=x["logprobs"], proximal_logprobs=x["proximal"],
                 advantages=x["values"], response_mask=x["kept"],
                 importance_weights=torch.exp(x["proximal"] - x["behavior"])))


@pytest.mark.parametrize("kind", KL_TYPES)
def test_every_kl_estimator_computes_on_the_device_of_its_inputs(kind: str) -> None:
    x = inputs()
    on_both(functools.partial(kl_penalty, kind=kind),
            dict(logprobs=x["logprobs"], ref_logprobs=x["reference"]))
    on_both(functools.partial(kl_reward_penalty, coef=0.1, kl_type=kind),
            dict(logprobs=x["logprobs"], reference_logprobs=x["reference"],
                 response_mask=x["mask"]))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_aggregation_computes_on_the_device_of_its_inputs(mode: str) -> None:
    x = inputs()
    on_both(functools.partial(aggregate_loss, mode=mode), dict(loss=x["values"], mask=x["mask"]))
    on_both(functools.partial(aggregate_loss, mode=mode, num_tokens=40.0, num_seqs=9,
                              horizon=7), dict(loss=x["values"], mask=x["mask"]))


CORRECTIONS = {"token is": RolloutCorrectionConfig(),
               "sequence rejection": RolloutCorrectionConfig(rollout_is="sequence",
                                                             rollout_rs="sequence"),
               "token rejection": RolloutCorrectionConfig(rollout_rs="token"),
               "token mask": RolloutCorrectionConfig(rollout_is="token_mask",
                                                     rollout_is_threshold=1.1),
               "m2po": RolloutCorrectionConfig(m2po=True, m2po_tau=0.05)}


@pytest.mark.parametrize("config", CORRECTIONS.values(), ids=CORRECTIONS.keys())
def test_every_off_policy_correction_computes_on_the_device_of_its_inputs(
        config: RolloutCorrectionConfig) -> None:
    x = inputs()
    on_both(functools.partial(off_policy_correction, config=config),
            dict(proximal_logprobs=x["proximal"], behavior_logprobs=x["behavior"],
                 response_mask=x["mask"]))


def test_a3po_computes_on_the_device_of_its_inputs() -> None:
    x = inputs()
    on_both(functools.partial(a3po_proximal_logprobs, proximal_version=2, current_version=2.5),
            dict(behavior_logprobs=x["behavior"], current_logprobs=x["logprobs"],
                 behavior_versions=x["versions"], response_mask=x["mask"]))


def test_prime_computes_on_the_device_of_its_inputs() -> None:
    """Its last-token mask and leave-one-out group sizes were built on the CPU."""
    x = inputs()
    on_both(functools.partial(implicit_process_rewards, beta=0.05),
            dict(prm_logprobs=x["logprobs"], ref_logprobs=x["reference"],
                 response_mask=x["mask"]))
    on_both(functools.partial(implicit_prm_loss, beta=0.05),
            dict(prm_logprobs=x["logprobs"], ref_logprobs=x["reference"],
                 response_mask=x["mask"], labels=x["rewards"]))
    on_both(functools.partial(prime_advantages, reward_dpo_coef=5.0, reward_gt_coef=5.0),
            dict(process_rewards=x["token_rewards"], outcome_rewards=x["rewards"],
                 response_mask=x["mask"], group_ids=x["group_ids"], kept_mask=x["kept"]))


def test_log_probs_entropy_and_value_loss_compute_on_the_device_of_their_inputs() -> None:
    x = inputs()
    on_both(functools.partial(token_logprobs, temperature=0.7),
            dict(logits=x["logits"], tokens=x["tokens"]))
    on_both(functools.partial(entropy_from_logits, temperature=0.7), dict(logits=x["logits"]))
    on_both(functools.partial(clipped_value_loss, cliprange_value=0.2),
            dict(values=x["values"], old_values=x["values"] * 0.9, returns=x["token_rewards"]))


# -- FakeTensorMode: torch's own device checks, for what reads no value on the host ------

PER_TOKEN = {
    "token_logprobs": lambda x: token_logprobs(x["logits"], x["tokens"], 0.7),
    "entropy": lambda x: entropy_from_logits(x["logits"], 0.7),
    "kl k3": lambda x: kl_penalty(x["logprobs"], x["reference"], "k3"),
    "kl in the reward": lambda x: kl_reward_penalty(x["logprobs"], x["reference"], x["mask"],
                                                    0.1, "low_var_kl"),
    "value loss": lambda x: clipped_value_loss(x["values"], x["values"] * 0.9,
                                               x["token_rewards"], 0.2),
    "a3po": lambda x: a3po_proximal_logprobs(x["behavior"], x["logprobs"], x["versions"],
                                             proximal_version=2, current_version=2.5,
                                             response_mask=x["mask"]),
    "importance weights": lambda x: off_policy_correction(x["proximal"], x["behavior"],
                                                          x["mask"], RolloutCorrectionConfig()),
    "vanilla policy loss": lambda x: policy_loss(
        x["logprobs"], x["proximal"], x["values"], x["mask"], PolicyLossConfig(),
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "prime process rewards": lambda x: implicit_process_rewards(x["logprobs"], x["reference"],
                                                                x["mask"], 0.05),
}


@pytest.mark.parametrize("fn", PER_TOKEN.values(), ids=PER_TOKEN.keys())
def test_per_token_functions_keep_fake_cuda_tensors_on_cuda(fn) -> None:
    with FakeTensorMode():  # (a fake tensor cannot be moved: .to takes a CUDA device guard)
        fake = {name: torch.empty(t.shape, dtype=t.dtype, device="cuda")
                for name, t in inputs().items()}
        results = [t for t in leaves(fn(fake)) if isinstance(t, torch.Tensor)]
    assert results and all(t.device.type == "cuda" for t in results)
