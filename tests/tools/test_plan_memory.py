"""tools/plan-memory.py: Qwen2.5-7B and -32B planned at 8 ranks x 80 GiB from their
config.json alone (no weights), as a table and as JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ..qwen25_configs import QWEN25_7B, QWEN25_32B, write_config

GIB = 1 << 30
TOOL = Path(__file__).resolve().parents[2] / "tools" / "plan-memory.py"
VERL_LIKE = ["model.enable_gradient_checkpointing=true", "actor.use_dynamic_bsz=true",
             "actor.ppo_max_token_len_per_gpu=16384", "data.max_prompt_length=1024",
             "rollout.response_length=4096"]


def plan_memory(*args: str) -> int:
    spec = importlib.util.spec_from_file_location("plan_memory", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(args))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen2.5")
    return {"7b": write_config(root / "7b", QWEN25_7B),
            "32b": write_config(root / "32b", QWEN25_32B) / "config.json"}  # a file works too


def planned_json(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[dict]]:
    code = plan_memory(*args, "--json")
    return code, json.loads(capsys.readouterr().out)


def test_7b_at_8_ranks_fits_80_gib_with_checkpointing_and_a_16k_budget(
        models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert plan_memory(str(models["7b"]), "--ranks", "8", "--gpu-gib", "80", *VERL_LIKE) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines()
             if line.strip().startswith("policy parameter shards (fp32)")]
    assert row.split(")")[1].split()[:2] == [f"{7_615_616_512 / 8 * 4 / GIB:.2f}", "always"]
    assert "16,384 tokens, 28 layers, checkpointed" in out
    assert "DOES NOT FIT" not in out and out.count(": fits") == 2  # learner, generator


def test_the_json_holds_every_item_and_a_peak_of_held_plus_the_largest_phase(
        models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    code, [learner, generator] = planned_json(capsys, str(models["7b"]), *VERL_LIKE)
    assert code == 0 and learner["fits"] and generator["fits"]
    phases = learner["phase_bytes"]
    largest = max(v for k, v in phases.items() if k != "held")
    assert learner["peak_bytes"] == phases["held"] + largest
    assert phases[learner["peak_phase"]] == largest
    held = sum(i["bytes"] for i in learner["items"] if i["phases"] == ["held"])
    assert held == phases["held"]
    assert {"weights", "KV cache"} <= {i["name"] for i in generator["items"]}


def test_fsdp_size_shards_each_model_over_fewer_ranks(
        models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    def shards(*args: str) -> int:
        _, [learner, _] = planned_json(capsys, str(models["7b"]), *VERL_LIKE, *args)
        return next(i["bytes"] for i in learner["items"]
                    if i["name"] == "policy parameter shards (fp32)")

    assert shards("--fsdp-size", "4") == 2 * shards() == 7_615_616_512 // 4 * 4


def test_32b_at_8_ranks_does_not_fit_without_offloading_and_says_so(
        models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    code, [learner, generator] = planned_json(capsys, str(models["32b"]), *VERL_LIKE)
    assert code == 1 and not learner["fits"] and learner["peak_bytes"] > 80 * GIB
    assert generator["problems"]  # 61 GiB of bf16 weights in half of one GPU: no KV cache
    code, [learner, generator] = planned_json(
        capsys, str(models["32b"]), *VERL_LIKE, "actor.fsdp_config.optimizer_offload=true",
        "--engine", "vllm", "--tensor-parallel", "4", "--gpu-memory-utilization", "0.8")
    assert code == 0 and learner["fits"] and generator["fits"]


def test_a_folder_without_a_config_is_refused(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan_memory(str(tmp_path))
    assert exit_.value.code == 2 and "config.json" in capsys.readouterr().err
