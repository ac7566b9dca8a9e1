"""``relay sft`` / ``tools/sft.py``: a tiny Llama's loss falls on the bundled arithmetic
data; a config problem exits 2 naming the key; the bundled files are what
``--arithmetic-data`` writes; two ranks train to one rank's weights; the output folder
trains with RL as ``model.path``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from relay.cli import COMMANDS
from relay.configs import CONFIG_DIR
from relay.sft import ARITHMETIC_FILES, main

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "sft.py"
STEP_LINE = re.compile(r"sft step (\d+)/(\d+)  loss ([\d.]+)(?:  val/loss ([\d.]+))?")


def arithmetic_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    data = CONFIG_DIR / "data"
    return [f"data.train_files={data / ARITHMETIC_FILES[0]}",
            f"data.val_files={data / ARITHMETIC_FILES[1]}", "data.prompt_key=question",
            "data.response_key=answer", f"model.partial_pretrain={model_dir}",
            f"trainer.default_local_dir={out}", "data.train_batch_size=32",
            "data.micro_batch_size_per_gpu=8", "optim.lr=3e-3", "trainer.device=cpu", *extra]


def run_script(args: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, RELAY_LOG_LEVEL="INFO")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=ROOT)


def test_the_loss_falls_on_the_bundled_data(random_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_script(arithmetic_args(random_model_dir, out, "trainer.total_training_steps=16",
                                        "trainer.test_freq=4"))
    assert result.returncode == 0, result.stderr
    steps = [m.groups() for m in STEP_LINE.finditer(result.stderr)]
    assert [int(s[0]) for s in steps] == list(range(1, 17))  # a progress line a step
    losses = [float(s[2]) for s in steps]
    val = [float(s[3]) for s in steps if s[3] is not None]
    assert len(val) == 4
    assert losses[-1] < 0.7 * losses[0], losses
    assert val == sorted(val, reverse=True), val  # the held-out loss falls at every test
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 17))
    assert run.data.params["optim.lr"] == "0.003" and run.info.status == "FINISHED"
    assert (out / "final" / "model.safetensors").is_file() and (out / "sft.toml").is_file()


def test_a_config_problem_exits_2_naming_the_key(random_model_dir: Path, tmp_path: Path,
                                                 capsys) -> None:
    assert main(arithmetic_args(random_model_dir, tmp_path, "optim.lr_schedule=cosine")) == 2
    assert "command line: optim.lr_schedule: unknown key; did you mean 'optim.lr_scheduler'" \
        in capsys.readouterr().err
    config = tmp_path / "sft.yaml"
    config.write_text("data:\n  train_files: t.jsonl\n  truncation: middle\n"
                      "model:\n  partial_pretrain: m\n")
    assert main([str(config)]) == 2
    assert f"{config}: data.truncation: expected one of" in capsys.readouterr().err


def test_the_bundled_files_are_what_arithmetic_data_writes(tmp_path: Path) -> None:
    assert main(["--arithmetic-data", str(tmp_path)]) == 0
    for name in ARITHMETIC_FILES:
        assert (tmp_path / name).read_text() == (CONFIG_DIR / "data" / name).read_text()


def test_relay_lists_sft() -> None:
    assert COMMANDS["sft"][0] == "relay.sft"


@pytest.mark.slow
@pytest.mark.parametrize("two_ranks, tolerance", [
    ([], 1e-5),  # data parallel
    (["ulysses_sequence_parallel_size=2", "use_remove_padding=true"], 5e-5),  # one SP group
])
def test_two_ranks_train_to_one_ranks_weights(random_model_dir: Path, tmp_path: Path,
                                              two_ranks: list[str], tolerance: float) -> None:
    finals = []
    for ranks, extra in ((1, []), (2, two_ranks)):
        out = tmp_path / f"ranks-{ranks}"
        result = run_script(arithmetic_args(random_model_dir, out, "trainer.total_training_steps=4",
                                            f"trainer.n_gpus_per_node={ranks}", *extra))
        assert result.returncode == 0, result.stderr
        finals.append(load_file(out / "final" / "model.safetensors"))
    worst = max(float((finals[0][k] - finals[1][k]).abs().max()) for k in finals[0])
    assert worst <= tolerance, worst


@pytest.mark.slow
@pytest.mark.e2e
def test_the_output_trains_one_rl_step(random_model_dir: Path, tmp_path: Path) -> None:
    from ...e2e.conftest import launch, only_run_dir, small_run_overrides

    out = tmp_path / "sft"
    result = run_script(arithmetic_args(random_model_dir, out, "trainer.total_training_steps=2"))
    assert result.returncode == 0, result.stderr
    runs = tmp_path / "runs"
    runs.mkdir()
    rl = launch(small_run_overrides(out / "final", runs, steps=1)
                + ["trainer.test_freq=-1", "trainer.val_before_train=false"])
    assert rl.returncode == 0, rl.stdout + rl.stderr
    trained = load_file(only_run_dir(runs) / "final" / "model.safetensors")
    start = load_file(out / "final" / "model.safetensors")
    assert trained.keys() == start.keys()
    assert any(float((trained[k] - start[k]).abs().max()) > 0 for k in start)
