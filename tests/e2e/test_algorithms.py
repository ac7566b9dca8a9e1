"""Each advantage estimator, policy-loss mode and off-policy correction, end to end.

A few steps through the real launcher (buffer, torchrun learner, generator) for each case:
the run must finish, log finite losses and gradient norms, and move every parameter.
Every estimator (ReMax with the generators' greedy baselines, PRIME with its implicit PRM)
and every loss mode appears at least once; the corrections, KL as a loss and in the reward,
A-3PO, the overlong penalty and the buffer's replay policies (prioritized by pass rate,
|advantage| and uniformly; PF-PPO best-worst) ride along.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from relay.buffer.rollout_log import read_rollout_log

from .conftest import launch, only_run_dir, small_run_overrides

pytestmark = pytest.mark.e2e

STEPS = 3
CASES = {
    "ppo-gae+critic-warmup": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95",
                              "trainer.critic_warmup=1", "critic.optim.lr=1e-3"],
    "rloo+gspo+pass-rate-replay": [
        "algorithm.adv_estimator=rloo", "actor.policy_loss.loss_mode=gspo",
        "actor.loss_agg_mode=seq-mean-token-mean", "buffer.replay.priority=pass_rate",
        "buffer.replay.max_reuse=2"],
    "reinforce++ +kl-in-reward": [
        "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05"],
    "reinforce++baseline+cispo+seq-is+advantage-replay": [
        "algorithm.adv_estimator=reinforce_plus_plus_baseline",
        "actor.policy_loss.loss_mode=cispo", "algorithm.rollout_correction.rollout_is=sequence",
        "buffer.replay.priority=advantage"],
    "opo+geo_mean+no-is+seq-rs": [
        "algorithm.adv_estimator=opo", "actor.policy_loss.loss_mode=geo_mean",
        "algorithm.rollout_correction.rollout_is=none",
        "algorithm.rollout_correction.rollout_rs=sequence"],
    "gpg+gpg+overlong+pf-ppo-best-worst": [
        "algorithm.adv_estimator=gpg", "actor.policy_loss.loss_mode=gpg",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.penalty_factor=0.5", "buffer.pf_ppo.enable=true",
        "buffer.pf_ppo.mode=best_worst"],
    "passk+sapo+token-rs": [
        "algorithm.adv_estimator=grpo_passk", "actor.policy_loss.loss_mode=sapo",
        "algorithm.rollout_correction.rollout_rs=token",
        "rollout.n=2"],  # a unique best sample (the only one pass@k trains) is then likely
    "drgrpo+clip_cov+m2po+a3po": [
        "algorithm.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor.policy_loss.loss_mode=clip_cov", "algorithm.rollout_correction.m2po=true",
        "actor.ppo_epochs=2", "actor.proximal_logprobs=a3po"],
    "grpo+kl_cov+minibatches+geometric-rs+uniform-replay": [
        "actor.policy_loss.loss_mode=kl_cov", "actor.ppo_mini_batch_size=2",
        "algorithm.rollout_correction.rollout_rs=geometric", "buffer.replay.priority=uniform"],
    "remax+kl-loss-k3+": ["algorithm.adv_estimator=remax", "actor.use_kl_loss=true",
                          "actor.kl_loss_type=k3+"],
    "prime": ["algorithm.adv_estimator=prime", "reward_model.model.optim.lr=1e-3"],
}
# Metrics a case must log every step besides the actor's.
CASE_METRICS = {"ppo-gae+critic-warmup": ["critic/vf_loss"],
                "prime": ["prm/loss", "prm/accuracy", "prm/grad_norm"]}


# The default suite keeps the critic, PRIME, mini-batches and ReMax's greedy baselines; the
# other combinations (each loss and estimator is unit-tested) run in the slow tier.
DEFAULT_TIER = {"ppo-gae+critic-warmup", "prime",
                "grpo+kl_cov+minibatches+geometric-rs+uniform-replay", "remax+kl-loss-k3+"}


@pytest.mark.parametrize("case", [
    case if case in DEFAULT_TIER else pytest.param(case, marks=pytest.mark.slow)
    for case in CASES])
def test_algorithm_trains_end_to_end(case: str, random_model_dir: Path,
                                     run_root: Path, tmp_path: Path) -> None:
    overrides = CASES[case]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = small_run_overrides(random_model_dir, run_root, steps=STEPS) + [
        f"tracking.uri={uri}", "tracking.experiment=algorithms", "actor.optim.lr=1e-3",
        f"trainer.save_freq={STEPS}", "trainer.test_freq=-1", *overrides]
    result = launch(args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("algorithms").experiment_id])
    warmup = 1 if "trainer.critic_warmup=1" in overrides else 0  # no actor update then
    expected = {"actor/loss": STEPS - warmup, "actor/grad_norm": STEPS - warmup,
                "actor/pg_loss": STEPS - warmup, "rollout/reward_mean": STEPS}
    expected.update({name: STEPS for name in CASE_METRICS.get(case, [])})
    for name, count in expected.items():
        history = client.get_metric_history(run.info.run_id, name)
        assert len(history) == count and all(math.isfinite(m.value) for m in history), name
    # one weight version per step that changed the policy: none during the critic's warm-up
    versions = client.get_metric_history(run.info.run_id, "version")
    assert max(m.value for m in versions) == STEPS - warmup

    trained = AutoModelForCausalLM.from_pretrained(
        only_run_dir(run_root) / "checkpoints" / f"step-{STEPS}" / "hf")
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir)
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters())]
    assert all(moved), "every parameter must have been trained"

    groups = list(read_rollout_log(only_run_dir(run_root) / "rollouts"))
    if case.startswith("remax"):  # every group came with its greedy response's reward and text
        assert groups and all(g.baseline_reward in (0.0, 1.0) for g in groups)
        assert all("greedy_text" in g.metadata for g in groups)
    else:
        assert all(g.baseline_reward is None for g in groups)
    if "reward_model.overlong_buffer.enable=true" in overrides:
        # response_length 8, buffer 4, factor 0.5: L > 4 tokens loses (L - 4) / 4 * 0.5
        samples = [s for g in groups for s in g.samples]
        assert any(len(s.response_ids) > 4 for s in samples)
        for sample in samples:
            penalty = -max(len(sample.response_ids) - 4, 0) / 4 * 0.5
            assert sample.reward_info["overlong_reward"] == pytest.approx(penalty)
            score = float(sum(map(ord, sample.text)) % 2)  # tests/e2e/reward_fn.py
            assert sample.reward == pytest.approx(score + penalty)
