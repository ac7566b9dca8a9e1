"""The buffer's replay policies in a real run: DAPO dynamic sampling and PF-PPO together,
the dynamic-sampling cap ending a run whose every group is dropped, and prioritized replay
by TD-error with PPO's critic (groups reused, priorities fed back by the learner)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.buffer.rollout_log import read_rollout_log

from .conftest import launch, only_run_dir, small_run_overrides

pytestmark = pytest.mark.e2e

STEPS = 3
# Half the prompts (by their answer) get the same reward for every sample, so dynamic
# sampling must drop them; the others get a reward that varies with the completion.
HALF_CONSTANT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if sum(map(ord, str(ground_truth))) % 2 == 0:
        return 1.0
    return float(sum(map(ord, solution_str)) % 2)
'''
CONSTANT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''


def reward_file(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "reward.py"
    path.write_text(source)
    return path


def test_dynamic_sampling_and_pf_ppo_train_on_filtered_groups(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = small_run_overrides(random_model_dir, run_root, steps=STEPS) + [
        f"tracking.uri={uri}", "tracking.experiment=filters", "trainer.test_freq=-1",
        f"custom_reward_function.path={reward_file(tmp_path, HALF_CONSTANT_REWARD)}",
        "buffer.filter_groups.enable=true", "buffer.filter_groups.max_num_gen_batches=50",
        "buffer.pf_ppo.enable=true", "buffer.pf_ppo.mode=best_random"]
    result = launch(args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("filters").experiment_id])

    def last(name: str) -> float:
        return client.get_metric_history(run.info.run_id, name)[-1].value

    assert last("buffer/dropped/zero_variance") > 0
    accepted = last("buffer/groups/accepted")
    assert accepted >= STEPS * 4
    assert last("buffer/samples/filtered") == 2 * accepted  # best_random keeps 2 of 4

    groups = list(read_rollout_log(only_run_dir(run_root) / "rollouts"))
    assert all(len(g.samples) == 4 for g in groups)  # logged whole, before the filters
    notes = [g.metadata["buffer_admission"] for g in groups]
    dropped = [g for g, note in zip(groups, notes) if note["dropped"]]
    kept = [note["kept_samples"] for note in notes if not note["dropped"]]
    assert dropped and all(len({s.reward for s in g.samples}) == 1 for g in dropped)
    assert kept and all(len(k) == 2 for k in kept)


def test_dynamic_sampling_cap_fails_the_run_with_a_clear_error(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    args = small_run_overrides(random_model_dir, run_root, steps=STEPS) + [
        f"custom_reward_function.path={reward_file(tmp_path, CONSTANT_REWARD)}",
        "trainer.test_freq=-1", "trainer.val_before_train=false",
        "buffer.filter_groups.enable=true", "buffer.filter_groups.max_num_gen_batches=2"]
    result = launch(args)
    assert result.returncode != 0
    assert "essential process buffer" in result.stderr
    assert "max_num_gen_batches = 2" in result.stderr, result.stderr[-3000:]


def test_prioritized_replay_by_td_error_reuses_groups_and_takes_the_learners_priorities(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    steps = 5
    args = small_run_overrides(random_model_dir, run_root, steps=steps) + [
        f"tracking.uri={uri}", "tracking.experiment=replay", "trainer.test_freq=-1",
        "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "buffer.max_staleness=2",
        "buffer.replay.priority=td_error", "buffer.replay.max_reuse=3",
        "buffer.replay.beta=1.0"]
    result = launch(args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {steps} steps" in result.stdout

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("replay").experiment_id])

    def history(name: str) -> list[float]:
        return [m.value for m in client.get_metric_history(run.info.run_id, name)]

    assert history("buffer/replay/draws")[-1] >= steps * 4
    assert history("buffer/replay/redraws")[-1] > 0  # some groups were trained on again
    # New groups start at priority 1 (the largest seen before any report); once the learner
    # reports TD-errors the stored priorities are those instead.
    assert any(p != 1.0 for p in history("buffer/replay/priority_mean")[1:])
    weights = history("buffer/replay/is_weight_min")
    assert all(0.0 < w <= 1.0 for w in weights) and min(weights) < 1.0
    assert all(math.isfinite(v) for v in history("critic/vf_loss") + history("actor/pg_loss"))
