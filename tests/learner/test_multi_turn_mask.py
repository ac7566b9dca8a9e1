"""Issue 33's mask tests: a multi-turn episode trains on the policy's tokens only.

A two-turn episode is one sample: prompt, turn 1 (the policy's), inserted tokens (the chat
template's turn markers and a tool response), turn 2 (the policy's), with ``loss_mask``
False on the inserted tokens. Three things are checked:

- the learner's loss, entropy, KL and gradients equal a reference written out below from a
  plain transformers forward, summed over the policy tokens only (and differ from it when
  the mask is all True: the test has teeth);
- whatever the batch holds off the response mask (behavior log-probs, versions) changes
  nothing, under every correction and estimator that reads them;
- behavior log-probs of an engine whose weights were swapped between the two turns equal
  the learner's recomputed ones (``forward_logprobs``) under the weights of each turn, with
  the tolerances of the single-turn test (``tests/generators/test_engines.py``,
  ``test_behavior_logprobs_are_the_temperature_only_ones_under_top_k_and_top_p``).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from relay.algorithms.off_policy import RolloutCorrectionConfig
from relay.algorithms.policy_loss import PolicyLossConfig
from relay.configs.run_schema import ActorConfig, AlgorithmConfig, OptimConfig, RolloutConfig
from relay.generators.lean_engine import LeanEngine
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import TrainBatch, collate
from relay.learner.model import forward_logprobs, load_sharded, sharding_mesh
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.update import Learner
from relay.transport.messages import RolloutGroup, Sample

from ..conftest import gather_full_weights, save_random_model
from .test_update import DATA

PROMPT = [1, 271, 201, 273, 272, 223, 19, 20, 280, 2, 201, 1, 278, 201]
# the end of turn 1, a tool response as a tool message, the start of turn 2
INSERTED = [2, 201, 1, 279, 201, 40, 41, 42, 43, 2, 201, 1, 278, 201]
TEMPERATURE = 1.0
ROLLOUT = RolloutConfig(temperature=TEMPERATURE, response_length=64)
KL_COEF, ENTROPY_COEF = 0.1, 0.01
GARBAGE_LOGPROB, GARBAGE_VERSION = 5.0, 12345  # impossible values, finite


def episode(seed: int, reward: float) -> Sample:
    """A hand-built two-turn episode: turns of random tokens and lengths around
    ``INSERTED``, behavior log-probs in [-3, -0.1] on the policy's tokens and 0 on the
    inserted ones, every token at version 0."""
    generator = torch.Generator().manual_seed(seed)
    turns = [torch.randint(3, 289, (int(n),), generator=generator).tolist()
             for n in torch.randint(2, 7, (2,), generator=generator)]
    response = turns[0] + INSERTED + turns[1]
    mask = torch.tensor([True] * len(turns[0]) + [False] * len(INSERTED)
                        + [True] * len(turns[1]))
    logprobs = -0.1 - 2.9 * torch.rand(len(response), generator=generator)
    return Sample(prompt_ids=torch.tensor(PROMPT, dtype=torch.int32),
                  response_ids=torch.tensor(response, dtype=torch.int32),
                  logprobs=torch.where(mask, logprobs, 0.0),
                  versions=torch.zeros(len(response), dtype=torch.int32), reward=reward,
                  loss_mask=mask)


def episodes(masked: bool = True) -> list[RolloutGroup]:
    """Two groups of three episodes with reward spread; ``masked`` False: the same tokens
    with every response token trained on (no loss mask)."""
    groups = []
    for index, rewards in enumerate(([1.0, 0.0, 0.0], [0.0, 1.0, 0.5])):
        samples = [episode(10 * index + k, r) for k, r in enumerate(rewards)]
        if not masked:
            samples = [msgspec.structs.replace(s, loss_mask=None) for s in samples]
        groups.append(RolloutGroup(rollout_id=str(index), lease_id="l", prompt_id=str(index),
                                   generator_id="g", samples=samples))
    return groups


def make_learner(path: Path, reference_path: Path, actor: ActorConfig,
                 algorithm: AlgorithmConfig) -> Learner:
    """A learner on the model at ``path`` with the frozen reference at ``reference_path``
    (another model, so that the KL terms are not 0), as ``relay.learner.main`` wires it."""
    mesh = sharding_mesh(torch.device("cpu"), -1)
    model = load_sharded(str(path), compute_dtype=torch.float32, device=torch.device("cpu"),
                         mesh=mesh)
    reference = load_sharded(str(reference_path), compute_dtype=torch.float32,
                             device=torch.device("cpu"), trainable=False, mesh=mesh)
    optimizer = build_optimizer(model, actor.optim)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10, optim=actor.optim),
                   actor=actor, algorithm=algorithm, rollout=ROLLOUT, data=DATA,
                   reference=reference)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("reference-model"), seed=7)


OPTIM = OptimConfig(lr=1e-3, weight_decay=0.0)
HAND_ACTOR = ActorConfig(optim=OPTIM, use_kl_loss=True, kl_loss_coef=KL_COEF,
                         kl_loss_type="low_var_kl", entropy_coeff=ENTROPY_COEF,
                         grad_clip=1e9)  # no clipping: Adam's first moment is (1 - b1) g
HAND_ALGORITHM = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="none"))


def hand_loss(model: torch.nn.Module, reference: torch.nn.Module,
              groups: list[RolloutGroup]) -> tuple[torch.Tensor, float, float]:
    """The step's loss written out, over each episode's policy tokens (its ``loss_mask``)
    only: token-mean of -A_i r_t + c_kl k3_t - c_H H_t with r_t = 1 (one update: the
    proximal policy is the current one), A_i GRPO's; and the mean entropy and KL."""
    terms, entropies, kls = [], [], []
    for group in groups:
        rewards = torch.tensor([s.reward for s in group.samples])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for sample, advantage in zip(group.samples, advantages, strict=True):
            ids = torch.cat([sample.prompt_ids, sample.response_ids]).long()[None]
            start = sample.prompt_ids.numel() - 1  # the logits that predict the response
            logits = model(ids).logits[0, start:-1].float() / TEMPERATURE
            with torch.no_grad():
                ref_logits = reference(ids).logits[0, start:-1].float() / TEMPERATURE
            policy = sample.loss_mask
            tokens = sample.response_ids.long()[:, None]
            logp = logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)[policy]
            ref = ref_logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)[policy]
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)[policy]
            d = logp - ref
            k3 = torch.exp(-d) - 1 + d
            ratio = torch.exp(logp - logp.detach())
            terms.append(-advantage * ratio + KL_COEF * k3 - ENTROPY_COEF * entropy)
            entropies.append(entropy.detach())
            kls.append(k3.detach())
    count = sum(len(t) for t in terms)
    return (torch.cat(terms).sum() / count, float(torch.cat(entropies).mean()),
            float(torch.cat(kls).mean()))


def first_moments(learner: Learner) -> list[torch.Tensor]:
    return [learner.optimizer.state[p]["exp_avg"].full_tensor().clone()
            for p in learner.model.parameters()]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("share_prompts", [True, False])
def test_loss_entropy_kl_and_gradients_are_those_of_the_policy_tokens_alone(
        random_model_dir: Path, reference_dir: Path, share_prompts: bool) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    loss, entropy, kl = hand_loss(model, reference, episodes())
    loss.backward()
    beta1 = OPTIM.betas[0]
    hand_moments = [(1 - beta1) * p.grad for p in model.parameters()]
    results = {}
    for masked in (True, False):
        torch.manual_seed(0)
        actor = msgspec.structs.replace(HAND_ACTOR, share_prompts=share_prompts)
        learner = make_learner(random_model_dir, reference_dir, actor, HAND_ALGORITHM)
        batch = collate(episodes(masked), pad_id=0)
        results[masked] = (learner.step(batch).metrics, first_moments(learner))
    metrics, moments = results[True]
    expected = {"actor/loss": (float(loss.detach()), 1e-5), "actor/entropy": (entropy, 1e-5),
                "actor/kl": (kl, 1e-6)}
    for name, (value, tolerance) in expected.items():
        assert metrics[name] == pytest.approx(value, abs=tolerance), name
    assert metrics["actor/tokens"] == sum(int(s.loss_mask.sum()) for g in episodes()
                                          for s in g.samples)
    scale = max(float(m.abs().max()) for m in hand_moments)
    for mine, theirs in zip(moments, hand_moments, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5 * scale, rtol=1e-4)
    # teeth: trained on every response token, the inserted ones too, all of it differs
    # (the random model's entropy is near log(vocabulary) everywhere: it moves least)
    everything, everything_moments = results[False]
    for name, (value, tolerance) in expected.items():
        assert abs(everything[name] - value) > 10 * tolerance, name
    assert max(float((a - b).abs().max()) for a, b in zip(everything_moments, hand_moments,
                                                          strict=True)) > 1e-2 * scale


@torch.no_grad()
def near_policy(groups: list[RolloutGroup], path: Path) -> list[RolloutGroup]:
    """``groups`` with behavior log-probs within 0.05 of those of the model at ``path`` on
    the policy's tokens, so that every correction keeps most tokens, at ratios near 1."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    out = []
    for group in groups:
        samples = []
        for sample in group.samples:
            ids = torch.cat([sample.prompt_ids, sample.response_ids]).long()[None]
            logits = model(ids).logits[0, sample.prompt_ids.numel() - 1:-1] / TEMPERATURE
            logp = logits.log_softmax(-1).gather(
                -1, sample.response_ids.long()[:, None]).squeeze(-1)
            noise = 0.1 * torch.rand(logp.shape, generator=generator) - 0.05
            samples.append(msgspec.structs.replace(sample, logprobs=torch.where(
                sample.loss_mask, (logp + noise).clamp(max=0.0), 0.0)))
        out.append(msgspec.structs.replace(group, samples=samples))
    return out


def with_garbage_off_the_mask(batch: TrainBatch) -> TrainBatch:
    """``batch`` with impossible behavior log-probs and versions wherever the response mask
    is 0: the inserted tokens, the prompts and the padding."""
    off = batch.response_mask == 0
    return msgspec.structs.replace(
        batch, behavior_logprobs=batch.behavior_logprobs.masked_fill(off, GARBAGE_LOGPROB),
        versions=batch.versions.masked_fill(off, GARBAGE_VERSION))


SETUPS = {
    "grpo, kl loss, entropy, token IS": (
        dict(use_kl_loss=True, kl_loss_coef=KL_COEF, entropy_coeff=ENTROPY_COEF),
        dict()),
    "reinforce++, kl in the reward, sequence IS, geometric rejection, m2po": (
        dict(), dict(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True,
                     rollout_correction=RolloutCorrectionConfig(
                         rollout_is="sequence", rollout_rs="geometric", m2po=True))),
    "a3po over two epochs, gspo, shared prompts, token mask": (
        dict(ppo_epochs=2, proximal_logprobs="a3po", share_prompts=True,
             policy_loss=PolicyLossConfig(loss_mode="gspo")),
        dict(rollout_correction=RolloutCorrectionConfig(rollout_is="token_mask"))),
    "geo_mean, recomputed proximal, two mini-batches, rloo, rows": (
        dict(ppo_mini_batch_size=1, proximal_logprobs="recompute", share_prompts=False,
             policy_loss=PolicyLossConfig(loss_mode="geo_mean")),
        dict(adv_estimator="rloo")),
}


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("setup", list(SETUPS))
def test_what_lies_off_the_mask_changes_nothing(random_model_dir: Path, reference_dir: Path,
                                                setup: str) -> None:
    """Behavior log-probs and versions off the response mask are never read: the metrics
    and the trained weights are bit for bit those of the clean batch."""
    actor_keys, algorithm_keys = SETUPS[setup]
    actor = ActorConfig(optim=OPTIM, **actor_keys)
    algorithm = AlgorithmConfig(**algorithm_keys)
    batch = collate(near_policy(episodes(), random_model_dir), pad_id=0)
    results = []
    for each in (batch, with_garbage_off_the_mask(batch)):
        torch.manual_seed(0)
        learner = make_learner(random_model_dir, reference_dir, actor, algorithm)
        metrics = learner.step(each).metrics
        results.append((metrics, gather_full_weights(learner.model, torch.float32)))
    (clean, clean_weights), (garbage, garbage_weights) = results
    assert clean["actor/rejected_frac"] < 0.5 and clean["actor/grad_norm"] > 0
    assert clean == garbage
    for name, weight in clean_weights.items():
        assert torch.equal(weight, garbage_weights[name]), name


# ------------------------------------------------------------- across a weight swap


FILTERED = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9)


def build_engine(kind: str, path: Path):
    common = dict(dtype=torch.float32, eos_ids=[-1], pad_id=0, seed=0)
    if kind == "lean":
        return LeanEngine.from_pretrained(str(path), max_num_seqs=16, max_len=64, **common)
    return TorchEngine.from_pretrained(str(path), **common)


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
            for name, p in model.named_parameters()}


def saved(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    model.load_state_dict(weights, strict=False)
    model.save_pretrained(folder)
    return folder


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("kind", ["lean", "torch"])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_behavior_logprobs_are_the_learners_on_each_turn_across_a_weight_swap(
        kind: str, share_prompts: bool, random_model_dir: Path, tmp_path: Path) -> None:
    """Turn 1 decoded by weights W1 (version 1), the tool response inserted, W2 (version 2)
    loaded, turn 2 decoded from the prompt, turn 1 and the inserted tokens. The learner's
    log-probs of the collated episode under W1 are the behavior ones on turn 1, under W2 on
    turn 2 (atol = rtol = 1e-4, as single-turn); the inserted tokens are off the mask."""
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    w1, w2 = perturbed(model, 1), perturbed(model, 2)
    engine = build_engine(kind, random_model_dir)
    prompts = [PROMPT, PROMPT[3:]]
    engine.load_weights(1, w1)
    turn_1 = engine.generate(prompts, FILTERED)
    engine.load_weights(2, w2)
    turn_2 = engine.generate([p + t.token_ids.tolist() + INSERTED
                              for p, t in zip(prompts, turn_1, strict=True)], FILTERED)
    samples = []
    for prompt, first, second in zip(prompts, turn_1, turn_2, strict=True):
        assert set(first.versions.tolist()) == {1} and set(second.versions.tolist()) == {2}
        inserted = len(INSERTED)
        samples.append(Sample(
            prompt_ids=torch.tensor(prompt, dtype=torch.int32),
            response_ids=torch.cat([first.token_ids, torch.tensor(INSERTED, dtype=torch.int32),
                                    second.token_ids]),
            logprobs=torch.cat([first.logprobs, torch.zeros(inserted), second.logprobs]),
            versions=torch.cat([first.versions, torch.full((inserted,), 2, dtype=torch.int32),
                                second.versions]),
            reward=1.0, loss_mask=torch.tensor([True] * len(first.token_ids)
                                               + [False] * inserted
                                               + [True] * len(second.token_ids))))
    batch = collate([RolloutGroup(rollout_id="r", lease_id="l", prompt_id="p",
                                  generator_id="g", samples=samples)], pad_id=0)
    turn_of = batch.versions  # 1 on turn 1, 2 on turn 2, -1 off the mask (inserted too)
    for row, sample in enumerate(samples):
        start = len(sample.prompt_ids) - 1
        span = turn_of[row, start:start + len(sample.response_ids)]
        assert span.tolist() == [1] * len(turn_1[row].token_ids) + [-1] * len(INSERTED) \
            + [2] * len(turn_2[row].token_ids)
    recomputed = {}
    for version, weights in ((1, w1), (2, w2)):
        folder = saved(AutoModelForCausalLM.from_pretrained(random_model_dir,
                                                            dtype=torch.float32),
                       weights, tmp_path / f"w{version}")
        learner_model = load_sharded(str(folder), compute_dtype=torch.float32,
                                     device=torch.device("cpu"), trainable=False)
        with torch.no_grad():
            recomputed[version], _ = forward_logprobs(learner_model, batch, FILTERED.temperature,
                                                      False, share_prompts=share_prompts)
    for version in (1, 2):
        on_turn = turn_of == version
        torch.testing.assert_close(recomputed[version][on_turn],
                                   batch.behavior_logprobs[on_turn], atol=1e-4, rtol=1e-4)
        # teeth: the other turn's weights give other log-probs on this turn's tokens
        other = recomputed[3 - version][on_turn]
        assert float((other - batch.behavior_logprobs[on_turn]).abs().max()) > 1e-2
        assert bool((recomputed[version][batch.response_mask == 0] == 0).all())
