"""verl's metric names: each alias copies its Relay metric's value under verl's name, Relay's
names stay, an alias whose meaning differs in the step (``unless``) is left out, and
``configs/verl-metrics.md`` is the table generated from the aliases."""

from __future__ import annotations

import subprocess
import sys

from relay.configs import CONFIG_DIR
from relay.learner.metric_names import ALIASES, markdown_table, with_verl_aliases

ROOT = CONFIG_DIR.parent


def test_verls_names_are_added_beside_relays() -> None:
    step = {"rollout/reward_mean": 0.5, "actor/clip_frac": 0.125, "actor/approx_kl": 0.01,
            "rollout/response_length_mean": 7.0, "rollout/truncated_frac": 0.25,
            "perf/step_seconds": 2.0, "buffer/occupancy": 3.0}
    assert with_verl_aliases(step) == {
        **step, "critic/score/mean": 0.5, "critic/rewards/mean": 0.5,
        "actor/pg_clipfrac": 0.125, "actor/ppo_kl": 0.01, "response_length/mean": 7.0,
        "response_length/clip_ratio": 0.25, "timing_s/step": 2.0, "perf/time_per_step": 2.0}


def test_verls_reward_is_not_the_score_under_a_kl_penalty_in_the_reward() -> None:
    aliased = with_verl_aliases({"rollout/reward_mean": 0.5, "actor/reward_kl": 0.02,
                                 "actor/reward_kl_coef": 0.001})
    assert aliased["critic/score/mean"] == 0.5 and "critic/rewards/mean" not in aliased
    assert aliased["actor/reward_kl_penalty"] == 0.02
    assert aliased["actor/reward_kl_penalty_coeff"] == 0.001


def test_a_name_the_step_already_logs_is_kept() -> None:
    assert with_verl_aliases({"actor/clip_frac": 0.1, "actor/pg_clipfrac": 0.2}) == {
        "actor/clip_frac": 0.1, "actor/pg_clipfrac": 0.2}


def test_each_verl_name_is_aliased_once_and_the_doc_lists_every_alias() -> None:
    names = [alias.verl for alias in ALIASES]
    assert len(names) == len(set(names))
    table = markdown_table()
    for alias in ALIASES:
        assert f"| `{alias.verl}` | `{alias.relay}` |" in table


def test_the_committed_doc_is_up_to_date() -> None:
    assert (CONFIG_DIR / "verl-metrics.md").read_text(encoding="utf-8") == markdown_table(), \
        "run tools/gen-verl-docs.py"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen-verl-docs.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
