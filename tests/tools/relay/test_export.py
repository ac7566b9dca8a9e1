"""``relay export``: a run's checkpoint becomes a Hugging Face folder (the newest by default,
``--step N`` for another, or a checkpoint folder named directly) in the run's dtype with its
tokenizer; ``--critic`` writes PPO's critic as ``AutoModelForTokenClassification`` computing
the learner's values, ``--prm`` PRIME's implicit PRM (greedy decoding of a bf16 export:
test_export_vllm.py). A folder that is no
run directory, a step with no checkpoint, a damaged checkpoint, a part the checkpoint does
not hold, a checkpoint without adapters for ``--merge-lora`` and an OUT_DIR in use each exit
2 with a message naming it, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from relay.configs import CONFIG_DIR
from relay.configs.loader import to_toml
from relay.configs.rundir import RESOLVED_RUN, RESOLVED_TOPOLOGY
from relay.configs.run_schema import AlgorithmConfig, DataConfig, ModelConfig, RunConfig
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


# -- a checkpoint folder named directly; the critic and the PRM ------------------------------


def checkpoint_of(learner: Learner, random_model_dir: Path, tmp_path: Path) -> Path:
    """``RUN_DIR/checkpoints/step-1`` of ``learner``, its weights moved off the model's by
    +0.01 so that what is exported is the checkpoint's, not ``model.path``'s."""
    run_dir = make_run_dir(tmp_path / "run", random_model_dir)
    with torch.no_grad():
        for part in (learner.model, learner.critic and learner.critic.model,
                     learner.prm and learner.prm.model):
            for param in part.parameters() if part is not None else ():
                param.add_(0.01)
    return save(learner, run_dir, 1, AutoTokenizer.from_pretrained(random_model_dir))


def test_a_checkpoint_folder_is_exported_as_is_in_the_dtype_asked(
        random_model_dir: Path, tmp_path: Path) -> None:
    learner = make_learner(random_model_dir)
    checkpoint = checkpoint_of(learner, random_model_dir, tmp_path)
    assert main([str(checkpoint), "--dtype", "bfloat16", str(tmp_path / "out")]) == 0
    back = loaded(tmp_path / "out")
    for name, weight in gather_full_weights(learner.model, torch.float32).items():
        assert torch.equal(back[name], weight.to(torch.bfloat16)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert (tmp_path / "out" / "generation_config.json").is_file()


def test_the_critic_is_a_token_classifier_computing_the_learners_values(
        random_model_dir: Path, tmp_path: Path) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="gae"))
    checkpoint = checkpoint_of(learner, random_model_dir, tmp_path)
    assert main([str(checkpoint), "--critic", "--dtype", "float32", str(tmp_path / "critic")]) == 0
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert critic.config.num_labels == 1 and critic.dtype == torch.float32
    ids = torch.tensor([[1, 271, 201, 273, 272, 223, 19, 20, 2]])
    learner.critic.model.eval()
    with torch.no_grad():
        expected = learner.critic.model(ids)
        got = critic(ids).logits[..., 0]
    assert expected.abs().max() > 0  # the value head moved off its zero start
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "critic")) > 0
    assert not (tmp_path / "critic" / "generation_config.json").exists()


def test_the_prm_is_a_causal_lm_with_the_checkpoints_weights(
        random_model_dir: Path, tmp_path: Path) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="prime"))
    checkpoint = checkpoint_of(learner, random_model_dir, tmp_path)
    assert main([str(checkpoint), "--prm", "--dtype", "float32", str(tmp_path / "prm")]) == 0
    back = loaded(tmp_path / "prm")
    for name, weight in gather_full_weights(learner.prm.model, torch.float32).items():
        assert torch.equal(back[name], weight), name


def test_a_part_the_checkpoint_does_not_hold_is_named(
        random_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint = checkpoint_of(make_learner(random_model_dir), random_model_dir, tmp_path)
    for flag, part in (("--critic", "critic"), ("--prm", "prm")):
        err = refused([str(checkpoint), flag, str(tmp_path / "out")], capsys)
        assert f"holds no {part} (its trained parts: policy)" in err and flag in err
    err = refused([str(checkpoint), "--merge-lora", str(tmp_path / "out")], capsys)
    assert "holds no LoRA adapters" in err and "adapter_config.json" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_critic_and_prm_exclude_each_other(tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--critic", "--prm", str(tmp_path / "out")])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_step_n_of_a_checkpoint_folder_is_refused(random_model_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    checkpoint = checkpoint_of(make_learner(random_model_dir), random_model_dir, tmp_path)
    err = refused([str(checkpoint), "--step", "1", str(tmp_path / "out")], capsys)
    assert f"{checkpoint} is a checkpoint already" in err
