"""``relay export``: a run's checkpoint becomes a Hugging Face folder (the newest by default,
``--step N`` for another) in the run's dtype with its tokenizer; a folder that is no run
directory, a step with no checkpoint, a damaged checkpoint and an OUT_DIR in use each exit 2
with a message naming it, writing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relay.configs import CONFIG_DIR
from relay.configs.loader import to_toml
from relay.configs.rundir import RESOLVED_RUN, RESOLVED_TOPOLOGY
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig
from relay.configs.topology_schema import Topology
from relay.export import main
from relay.learner.checkpoint import LoopState, save_checkpoint
from relay.learner.checkpoint_meta import Lineage
from relay.learner.update import Learner

from ...conftest import gather_full_weights
from ...learner.test_update_algorithms import make_learner

pytestmark = pytest.mark.usefixtures("one_rank_group")


def make_run_dir(folder: Path, model_dir: Path, dtype: str = "bfloat16") -> Path:
    """A run directory as the launcher writes it: the resolved topology and run config."""
    folder.mkdir()
    run = RunConfig(data=DataConfig(train_files=[str(CONFIG_DIR / "data" /
                                                     "arithmetic-train.jsonl")]),
                    model=ModelConfig(path=str(model_dir), dtype=dtype))
    (folder / RESOLVED_RUN).write_bytes(to_toml(run))
    (folder / RESOLVED_TOPOLOGY).write_bytes(to_toml(Topology()))
    return folder


def save(learner: Learner, run_dir: Path, step: int, tokenizer) -> Path:
    return save_checkpoint(learner, run_dir / "checkpoints", LoopState(step=step, version=step),
                           lineage=Lineage(id="run"), keep_last=3, tokenizer=tokenizer)


@pytest.fixture
def trained_run(random_model_dir: Path, tmp_path: Path) -> tuple[Path, dict, dict]:
    """A run directory with checkpoints of steps 1 and 2 (one training step apart), and the
    policy's weights at each."""
    run_dir = make_run_dir(tmp_path / "run", random_model_dir)
    learner = make_learner(random_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    save(learner, run_dir, 1, tokenizer)
    first = {name: weight.clone()
             for name, weight in gather_full_weights(learner.model, torch.float32).items()}
    with torch.no_grad():
        for param in learner.model.parameters():
            param.add_(0.01)
    save(learner, run_dir, 2, tokenizer)
    return run_dir, first, gather_full_weights(learner.model, torch.float32)


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())


def test_the_newest_checkpoint_is_exported_in_the_runs_dtype_with_its_tokenizer(
        trained_run: tuple[Path, dict, dict], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    run_dir, _first, newest = trained_run
    assert main([str(run_dir), str(tmp_path / "out")]) == 0
    assert "step-2" in capsys.readouterr().out
    back = loaded(tmp_path / "out")
    for name, weight in newest.items():
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name], weight.to(torch.bfloat16)), name
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) > 0
    assert not (tmp_path / "out.tmp").exists()


def test_step_n_exports_that_checkpoint_and_dtype_overrides_the_runs(
        trained_run: tuple[Path, dict, dict], tmp_path: Path) -> None:
    run_dir, first, _newest = trained_run
    (tmp_path / "empty").mkdir()  # an empty OUT_DIR is taken
    assert main([str(run_dir), "--step", "1", "--dtype", "float32",
                 str(tmp_path / "empty")]) == 0
    back = loaded(tmp_path / "empty")
    for name, weight in first.items():
        assert torch.equal(back[name], weight), name


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_folder_that_is_no_run_directory_is_named(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    err = refused([str(tmp_path), str(tmp_path / "out")], capsys)
    assert f"{tmp_path}: not a run directory" in err
    assert not (tmp_path / "out").exists()


def test_a_run_without_checkpoints_points_at_its_final_folder(
        random_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(tmp_path / "run", random_model_dir)
    err = refused([str(run_dir), str(tmp_path / "out")], capsys)
    assert f"{run_dir / 'checkpoints'}: no complete checkpoint" in err
    assert str(run_dir / "final") in err


def test_a_step_without_a_checkpoint_names_the_steps_there_are(
        trained_run: tuple[Path, dict, dict], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    run_dir, _first, _newest = trained_run
    err = refused([str(run_dir), "--step", "7", str(tmp_path / "out")], capsys)
    assert "step 7:" in err and "step-7" in err and "steps: 1, 2" in err
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_is_refused_naming_the_file(
        trained_run: tuple[Path, dict, dict], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    run_dir, _first, _newest = trained_run
    weights = run_dir / "checkpoints" / "step-2" / "hf" / "model.safetensors"
    weights.chmod(0o600)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    weights.chmod(0o400)
    err = refused([str(run_dir), str(tmp_path / "out")], capsys)
    assert "step-2 is damaged, not exported" in err and "model.safetensors" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_an_out_dir_in_use_is_not_overwritten(trained_run: tuple[Path, dict, dict],
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    run_dir, _first, _newest = trained_run
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    err = refused([str(run_dir), str(out)], capsys)
    assert f"{out}: already exists" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
