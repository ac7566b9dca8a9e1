"""Four of verl's own example scripts, with only the entry point swapped for
``tools/launch-cluster.py`` and the model pointed at a local one (``verl_examples/``), pass
``--dry-run`` and resolve to the Relay settings their verl keys stand for.

The scripts' ``rollout.name`` (vllm; sglang in one) picks every generator's engine, and the
dry run checks that its package is installed, as the launch does. SGLang never is on a CPU
machine, and vLLM only with the ``vllm`` extra: there a user appends another
``actor_rollout_ref.rollout.name`` to the script's command line (its ``$@`` comes after the
script's own overrides, and the last value wins), as ``engine_args`` does."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import load_prompt_rows, write_prompt_rows
from relay.configs.verl_keys import ROLLOUT_NAME
from relay.generators.build import missing_engine

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = Path(__file__).with_name("verl_examples")
TRAIN_ROWS = 2048  # two of the scripts' 1024-prompt batches an epoch
ENGINE = "vllm" if missing_engine("vllm") is None else "lean"
"""The engine a user of this machine runs verl's examples with: vLLM where it is installed,
else Relay's own."""


def engine_args(script_engine: str) -> list[str]:
    """What a user of this machine appends to a script whose ``rollout.name`` is
    ``script_engine``: nothing where that engine is ``ENGINE``, else ``rollout.name=ENGINE``."""
    return [] if script_engine == ENGINE else [f"{ROLLOUT_NAME}={ENGINE}"]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A $HOME whose data/ holds the scripts' parquet files, made of Relay's arithmetic rows."""
    home = tmp_path_factory.mktemp("home")
    train = load_prompt_rows(CONFIG_DIR / "data" / "arithmetic-train.jsonl")[:TRAIN_ROWS]
    test = load_prompt_rows(CONFIG_DIR / "data" / "arithmetic-test.jsonl")[:64]
    for name in ("gsm8k", "math"):
        write_prompt_rows(home / "data" / name / "train.parquet", train)
        write_prompt_rows(home / "data" / name / "test.parquet", test)
    return home


def dry_run(script: str, home: Path, model: Path, *args: str,
            refused: bool = False) -> tuple[dict, dict, str]:
    """The resolved run config and topology of ``bash verl_examples/<script> ARGS --dry-run``,
    and its output (its error output where the launcher ``refused`` it)."""
    env = dict(os.environ, HOME=str(home), MODEL_PATH=str(model),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(EXAMPLES / script), *args, "--dry-run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    if refused:
        assert done.returncode == 2, done.stdout[-3000:]
        return {}, {}, done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    topology_toml, rest = done.stdout.split("# Resolved topology")[1].split("\n", 1)[1].split(
        "# Resolved run config")
    run_toml = rest.split("\n", 1)[1].split("# verl keys")[0]
    return tomllib.loads(run_toml), tomllib.loads(topology_toml), done.stdout


def engines(topology: dict) -> set[str]:
    """The engines of the generators and the evaluator of a resolved topology."""
    return {g["engine"] for g in topology["generators"]} | {topology["evaluator"]["engine"]}


def test_the_sglang_example_is_refused_here_naming_rollout_name(home: Path,
                                                                random_model_dir: Path) -> None:
    if missing_engine("sglang") is None:
        pytest.skip("SGLang is installed here")
    *_, err = dry_run("grpo_qwen2-7b_seq_balance.sh", home, random_model_dir, refused=True)
    assert f"command line: {ROLLOUT_NAME}: engine 'sglang' needs the sglang package" in err
    assert f"give another engine there (e.g. {ROLLOUT_NAME}=lean" in err


def test_grpo_with_sequence_balancing(home: Path, random_model_dir: Path) -> None:
    run, topology, out = dry_run("grpo_qwen2-7b_seq_balance.sh", home, random_model_dir,
                                 *engine_args("sglang"))
    assert engines(topology) == {ENGINE}
    assert run["algorithm"]["adv_estimator"] == "grpo" and run["rollout"]["n"] == 5
    assert run["rollout"]["response_length"] == 1024  # data.max_response_length
    actor = run["actor"]
    assert actor["use_dynamic_bsz"] and actor["ppo_max_token_len_per_gpu"] == 24000
    assert actor["use_kl_loss"] and actor["ppo_mini_batch_size"] == 256
    assert run["ref"]["fsdp_config"]["param_offload"] is True
    assert run["data"]["filter_overlong_prompts"] and run["data"]["truncation"] == "error"
    assert run["trainer"]["total_training_steps"] == 15 * 2  # 15 epochs of 2 batches
    assert run["tracking"]["experiment"] == "verl_grpo_example_gsm8k"
    assert "--nproc-per-node=8" in out  # trainer.n_gpus_per_node
    # the dry run names what each verl key became
    assert "#   data.max_response_length = 1024 -> rollout.response_length" in out
    assert "#   trainer.n_gpus_per_node = 8 -> topology.learner.nproc_per_node" in out


def test_grpo_qwen3(home: Path, random_model_dir: Path) -> None:
    run, topology, out = dry_run("grpo_qwen3-8b.sh", home, random_model_dir,
                                 *engine_args("vllm"))
    assert engines(topology) == {ENGINE} and "#   rollout.name = 'vllm' -> " in out
    for options in (topology["generators"][0]["vllm"], topology["evaluator"]["sglang"]):
        assert options["gpu_memory_utilization"] == 0.6
        assert options["tensor_model_parallel_size"] == 2
    assert run["actor"]["ppo_micro_batch_size_per_gpu"] == 32
    assert run["ref"]["log_prob_micro_batch_size_per_gpu"] == 32
    assert run["actor"]["kl_loss_type"] == "low_var_kl"


def test_ppo_with_a_critic(home: Path, random_model_dir: Path) -> None:
    run, topology, _ = dry_run("ppo_deepseek7b_llm.sh", home, random_model_dir,
                               *engine_args("vllm"))
    assert engines(topology) == {ENGINE}
    assert topology["generators"][0]["vllm"]["gpu_memory_utilization"] == 0.4
    assert run["algorithm"]["adv_estimator"] == "gae"
    assert run["critic"]["optim"]["lr"] == 1e-5
    assert run["critic"]["model"]["path"] == str(random_model_dir)
    assert run["model"]["enable_gradient_checkpointing"] is True
    assert run["trainer"]["test_freq"] == 1


def test_gmpo_geo_mean(home: Path, random_model_dir: Path) -> None:
    run, topology, _ = dry_run("gmpo_qwen2_5-7b_math.sh", home, random_model_dir,
                               *engine_args("vllm"))
    assert engines(topology) == {ENGINE}
    assert run["actor"]["policy_loss"]["loss_mode"] == "geo_mean"
    assert run["actor"]["clip_ratio_low"] == run["actor"]["clip_ratio_high"] == 0.4
    assert run["data"]["train_files"] == [str(home / "data" / name / "train.parquet")
                                          for name in ("gsm8k", "math")]
    assert run["trainer"]["total_training_steps"] == 15 * 4  # two files of 2048 rows
