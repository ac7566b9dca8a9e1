"""The code reward agrees with HumanEval's labels (tools/code-reward-agreement.py): canonical
solutions pass and corrupted ones fail, through the reward worker and the local sandbox."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from relay.algorithms.rewards import RewardConfig, RewardScorer
from relay.algorithms.sandbox import SandboxSettings

TOOL = Path(__file__).resolve().parents[3] / "tools" / "code-reward-agreement.py"


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_reward_agreement", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_humaneval_ships_all_164_problems() -> None:
    problems = load_tool().load_problems()
    assert len(problems) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and problems[-1]["task_id"] == "HumanEval/163"


@pytest.mark.timeout(300)
def test_the_first_problems_canonical_pass_and_corrupted_fail() -> None:
    tool = load_tool()
    with RewardScorer(RewardConfig(timeout_s=20.0), SandboxSettings(workers=2)) as scorer:
        wrong = tool.agreement(scorer, tool.load_problems()[:6])
    assert wrong == {variant: [] for variant in tool.VARIANTS}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_all_of_humaneval_agrees_at_99_percent_or_better() -> None:
    assert load_tool().main([]) == 0  # it prints each variant's agreement (pytest -s)
