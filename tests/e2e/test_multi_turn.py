"""Multi-turn rollouts through ``tools/launch-cluster.py``: a user's own workflow from a file
outside the package (``user_workflow.py``) trains 3 steps, by file path and by module path; a
workflow that raises ends the run naming itself and the prompt; verl's multi-turn GSM8K tool
recipe (``tests/tools/launcher/verl_examples/run_qwen2.5-3b_gsm8k_multiturn.sh``, verl's
Hydra file and tool YAML beside it) passes ``--dry-run`` and trains the embedded default with
the GSM8K tool.

The recipe's rows are verl's ``gsm8k_multiturn_w_tool`` rows, built from the GSM8K train split
in ``../shared/data`` by ``tools/prepare-gsm8k-tool-data.py`` (the tests skip without it).
The embedded default (``builtin:tiny-arith``) has 256 positions, fewer than verl's system
message alone takes, so its training rows leave that message out (``--no-system``); it rarely
calls a tool, so the test asserts what is deterministic: episodes ran through the tool loop
and the run finished."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from mlflow import MlflowClient

from .conftest import ROOT, launch, only_run_dir, processes_mentioning

pytestmark = pytest.mark.e2e

USER = Path(__file__).with_name("user_workflow.py").relative_to(ROOT)  # from the cwd
FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]
SHORT_RUN = ["trainer.total_training_steps=3", "trainer.test_freq=-1",
             "trainer.val_before_train=false", "rollout.response_length=48"]
SCRIPT = ROOT / "tests" / "tools" / "launcher" / "verl_examples" / \
    "run_qwen2.5-3b_gsm8k_multiturn.sh"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
PREPARE = ROOT / "tools" / "prepare-gsm8k-tool-data.py"
RECIPE_TOOLS = SCRIPT.parent / "sglang_multiturn" / "config" / "tool_config" / \
    "gsm8k_tool_config.yaml"

NEWER_KEYS = [  # the script's keys at verl v0.7.0 that v0.5.0's lacks
    "global_profiler.tool=torch_memory", "global_profiler.save_path=./mem_snapshots",
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000",
    "global_profiler.global_tool_config.torch_memory.stack_depth=32",
    "actor_rollout_ref.rollout.multi_stage_wake_up=True",
    "actor_rollout_ref.rollout.over_sample_rate=0.1", "actor_rollout_ref.rollout.mode=async",
    "trainer.val_before_train=True"]


def metric_histories(uri: str, experiment: str, *names: str) -> dict[str, list[float]]:
    """Each metric's values over the steps of the one run of ``experiment``."""
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {name: [m.value for m in client.get_metric_history(run.info.run_id, name)]
            for name in names}


@pytest.mark.slow
def test_a_user_workflow_from_a_file_trains_three_steps(run_root: Path, tmp_path: Path) -> None:
    """About 35 s."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = launch([f"trainer.run_dir={run_root}", *FREE_PORTS, *SHORT_RUN,
                     f"tracking.uri={uri}", "tracking.experiment=workflow",
                     f"rollout.workflow={USER}:run_episode"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "steps              3/3" in result.stdout
    assert processes_mentioning(str(only_run_dir(run_root))) == []
    history = metric_histories(uri, "workflow", "rollout/turns_mean",
                               "rollout/policy_token_frac", "rollout/reward_mean")
    # every episode played both turns, and the inserted user reply is masked out of the loss
    assert history["rollout/turns_mean"] == [2.0] * 3
    assert all(0 < frac < 1 for frac in history["rollout/policy_token_frac"])
    assert len(history["rollout/reward_mean"]) == 3  # the workflow's own reward


def test_a_user_workflow_by_module_path_passes_the_dry_run(
        run_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run loads the workflow as the generators will (a missing or non-async one is
    refused: tests/generators/test_workflow.py)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / USER.parent))
    result = launch(["--dry-run", f"trainer.run_dir={run_root}",
                     f"rollout.workflow={USER.stem}:run_episode"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'workflow = "{USER.stem}:run_episode"' in result.stdout


@pytest.mark.slow
def test_a_workflow_that_raises_ends_the_run_naming_it_and_the_prompt(run_root: Path) -> None:
    """The generator dies on the first episode with the workflow's error (it is not
    restarted); with no generator left for 120 s the run fails (about 2.5 minutes)."""
    result = launch([f"trainer.run_dir={run_root}", *FREE_PORTS, *SHORT_RUN,
                     f"rollout.workflow={USER}:raising"])
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "run FAILED: every generator died" in output
    died = next(line for line in output.splitlines() if "generator gen0 died" in line)
    assert "WorkflowError: rollout.workflow '" in died  # the path as given, or made absolute
    assert f"{USER}:raising' raised on prompt " in died
    assert "RuntimeError: user_workflow.raising cannot play" in died
    log = (only_run_dir(run_root) / "logs" / "gen0.log").read_text()
    assert "WorkflowError" in log and "raised on prompt" in log


@pytest.fixture(scope="module")
def gsm8k_tool_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A $HOME whose data/gsm8k holds verl's GSM8K-with-tool rows: ``train.parquet`` (512
    rows, two of the script's 256-prompt batches) and ``test.parquet``, both as verl writes
    them; and ``data/short/train.parquet``, 64 rows without the system message, for the
    tiny model."""
    if not GSM8K.is_file():
        pytest.skip(f"the GSM8K train split is not at {GSM8K}")
    home = tmp_path_factory.mktemp("home")
    for folder, split, rows, extra in (("gsm8k", "train", 512, []), ("gsm8k", "test", 8, []),
                                       ("short", "train", 64, ["--no-system"])):
        out = home / "data" / folder / f"{split}.parquet"
        subprocess.run([sys.executable, str(PREPARE), str(GSM8K), str(out), "--rows",
                        str(rows), "--split", split, *extra], check=True,
                       capture_output=True, text=True)
    return home


def run_recipe(home: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    # the model cache stays the user's own: $HOME is a scratch folder
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=cache,
               MODEL_PATH="builtin:tiny-arith", RELAY_LOG_LEVEL="INFO",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def test_verls_multi_turn_gsm8k_recipe_passes_the_dry_run(gsm8k_tool_home: Path) -> None:
    """Its SGLang is refused on a CPU machine, so a user appends another engine (the last
    value wins), as for verl's other SGLang example. The keys verl's newer copies of the
    script add (``NEWER_KEYS``) pass too."""
    done = run_recipe(gsm8k_tool_home, "actor_rollout_ref.rollout.name=lean", *NEWER_KEYS,
                      "--dry-run")
    assert done.returncode == 0, done.stderr[-3000:]
    run_toml = done.stdout.split("# Resolved run config")[1].split("\n", 1)[1] \
        .split("# verl keys")[0]
    run = tomllib.loads(run_toml)
    # the recipe's Hydra file (--config-path/--config-name) and its command line, merged
    multi_turn = run["rollout"]["multi_turn"]
    assert multi_turn["enable"] is True and multi_turn["max_assistant_turns"] == 5
    assert multi_turn["tool_config_path"] == str(RECIPE_TOOLS)
    assert run["rollout"]["n"] == 16 and run["rollout"]["response_length"] == 1024
    assert run["data"]["train_batch_size"] == 256
    assert run["tracking"]["experiment"] == "gsm8k_async_rl"
    assert "verl.tools.gsm8k_tool.Gsm8kTool runs as Relay's " \
        "relay.generators.tools.gsm8k.Gsm8kTool" in done.stderr
    assert "#   rollout.over_sample_rate = 0.1: generators stream" in done.stdout


@pytest.mark.slow
def test_verls_multi_turn_gsm8k_recipe_trains_the_embedded_default(
        gsm8k_tool_home: Path, run_root: Path, tmp_path: Path) -> None:
    """Small settings appended to the script's ``$@`` (about 45 s)."""
    short = gsm8k_tool_home / "data" / "short" / "train.parquet"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = run_recipe(
        gsm8k_tool_home, "actor_rollout_ref.rollout.name=lean", "trainer.n_gpus_per_node=1",
        f"data.train_files={short}", f"data.val_files={short}",
        "data.max_prompt_length=160", "data.max_response_length=64",  # 256 positions in all
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=3",
        "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.run_dir={run_root}", f"tracking.uri={uri}", "trainer.logger=['console']",
        *FREE_PORTS, timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "trained 3 steps" in done.stdout
    run_dir = only_run_dir(run_root)
    assert processes_mentioning(str(run_dir)) == []
    history = metric_histories(uri, "gsm8k_async_rl", "rollout/turns_mean",
                               "rollout/tool_calls_mean")
    # every step trained on tool-loop episodes (at most max_assistant_turns = 5 turns each)
    assert len(history["rollout/turns_mean"]) == 3
    assert all(1 <= turns <= 5 for turns in history["rollout/turns_mean"])
    assert len(history["rollout/tool_calls_mean"]) == 3
    assert "Gsm8kTool" in (run_dir / "logs" / "gen0.log").read_text()  # the loop loaded it
