"""``relay import-verl``: a checkpoint in verl's 2-rank FSDP layout (``actor/`` and ``critic/``,
each ``model_world_size_2_rank_{0,1}.pt`` of DTensor shards saved by a real 2-rank gloo run,
``huggingface/`` with config and tokenizer) becomes Hugging Face folders whose tensors equal
the models saved; replicated DTensors (checked equal) and an HSDP ``("ddp", "fsdp")`` mesh
merge too, plain-tensor shards on dim 0; missing ranks, disagreeing world sizes,
a missing ``huggingface/config.json``, shards whose keys differ, ``--optimizer`` and an
OUT_DIR in use each exit 2 with a message naming the file, writing nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
)

from relay.import_verl import VerlImportError, main, merge_shards

from ...conftest import exit_worker, free_port, save_random_model


def critic_model(model_dir: Path) -> torch.nn.Module:
    """verl's critic: the model's body under a one-label token-classification head."""
    torch.manual_seed(1)
    config = LlamaConfig.from_pretrained(model_dir, num_labels=1)
    return AutoModelForTokenClassification.from_config(config)


def save_like_verl(rank: int, port: int, model_dir: Path, folder: Path) -> None:
    """One rank of a 2-rank FSDP2 run saving as verl's ``FSDPCheckpointManager`` does."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    for part, model in (("actor", AutoModelForCausalLM.from_pretrained(model_dir)),
                        ("critic", critic_model(model_dir))):
        out = folder / part
        fully_shard(model, mesh=mesh)
        torch.save(model.state_dict(), out / f"model_world_size_2_rank_{rank}.pt")
        optimizer = torch.optim.AdamW(model.parameters())
        torch.save(optimizer.state_dict(), out / f"optim_world_size_2_rank_{rank}.pt")
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ddp", "fsdp"))
    torch.save({"replicated": distribute_tensor(MERGED["replicated"], mesh, [Replicate()]),
                "hsdp": distribute_tensor(MERGED["hsdp"], hsdp, [Replicate(), Shard(1)])},
               folder / "other" / f"model_world_size_2_rank_{rank}.pt")
    dist.destroy_process_group()
    exit_worker()


MERGED = {"replicated": torch.arange(6.0).reshape(2, 3),
          "hsdp": torch.arange(15.0).reshape(3, 5)}  # sharded on dim 1, unevenly


@pytest.fixture(scope="module")
def verl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``global_step_1/`` as verl writes it from two ranks, and the model it started from."""
    root = tmp_path_factory.mktemp("verl")
    model_dir = save_random_model(root / "model", hidden=64)
    checkpoint = root / "global_step_1"
    for part in ("actor", "critic"):
        hf = checkpoint / part / "huggingface"
        hf.mkdir(parents=True)
        LlamaConfig.from_pretrained(model_dir).save_pretrained(hf)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(hf)
        (checkpoint / part / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 2, "world_size": 2}))
    (checkpoint / "other").mkdir()
    mp.spawn(save_like_verl, args=(free_port(), model_dir, checkpoint), nprocs=2)
    return checkpoint, model_dir


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "global_step_1"))


def test_two_fsdp_ranks_of_dtensor_shards_round_trip_to_equal_tensors(
        verl_checkpoint: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    checkpoint, model_dir = verl_checkpoint
    shards = torch.load(checkpoint / "actor" / "model_world_size_2_rank_1.pt",
                        weights_only=True)
    assert type(shards["model.norm.weight"]).__name__ == "DTensor"  # what verl saves
    assert main([str(checkpoint), str(tmp_path / "out")]) == 0
    assert "critic" in capsys.readouterr().out
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    for name, weight in original.state_dict().items():
        assert torch.equal(actor.state_dict()[name], weight), name
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "out" / "critic")
    expected = critic_model(model_dir).state_dict()
    assert critic.config.num_labels == 1
    assert critic.score.weight.shape == (1, 64)  # one row over two ranks: rank 1 held none
    for name, weight in expected.items():
        assert torch.equal(critic.state_dict()[name], weight), name
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) > 0
    assert (tmp_path / "out" / "generation_config.json").is_file()


def test_dtype_is_written_and_recorded(verl_checkpoint: tuple[Path, Path],
                                       tmp_path: Path) -> None:
    checkpoint, model_dir = verl_checkpoint
    assert main([str(checkpoint / "actor"), "--dtype", "bfloat16", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    weights = load_file(tmp_path / "out" / "model.safetensors")
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for name, weight in weights.items():
        assert torch.equal(weight, original[name].to(torch.bfloat16)), name
    assert not (tmp_path / "out" / "critic").exists()  # a single folder is the actor


def test_plain_tensor_shards_are_concatenated_on_dim_0(tmp_path: Path) -> None:
    full = {"a": torch.arange(10.0).reshape(5, 2), "b": torch.arange(3.0)}
    for rank in range(2):
        torch.save({name: tensor.chunk(2)[rank] for name, tensor in full.items()},
                   tmp_path / f"model_world_size_2_rank_{rank}.pt")
    merged = merge_shards([tmp_path / f"model_world_size_2_rank_{r}.pt" for r in range(2)])
    assert merged.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name


def test_replicated_and_hsdp_dtensors_merge_and_differing_copies_are_named(
        verl_checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    paths = [verl_checkpoint[0] / "other" / f"model_world_size_2_rank_{r}.pt" for r in range(2)]
    merged = merge_shards(paths)
    for name, tensor in MERGED.items():
        assert torch.equal(merged[name], tensor), name
    shard = torch.load(paths[1], weights_only=True)
    shard["replicated"].to_local().add_(1.0)
    torch.save(shard, tmp_path / paths[1].name)
    with pytest.raises(VerlImportError, match="replicated: replicated, but rank 1's copy differs"):
        merge_shards([paths[0], tmp_path / paths[1].name])


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_missing_rank_is_named(verl_checkpoint: tuple[Path, Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    checkpoint = copy_of(verl_checkpoint[0], tmp_path)
    (checkpoint / "critic" / "model_world_size_2_rank_1.pt").unlink()
    err = refused([str(checkpoint), str(tmp_path / "out")], capsys)
    assert "critic: missing rank of world size 2: model_world_size_2_rank_1.pt" in err
    assert not (tmp_path / "out").exists()  # checked before the actor is written


def test_world_sizes_that_disagree_are_named(verl_checkpoint: tuple[Path, Path],
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    checkpoint = copy_of(verl_checkpoint[0], tmp_path)
    actor = checkpoint / "actor"
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_4_rank_0.pt")
    err = refused([str(checkpoint), str(tmp_path / "out")], capsys)
    assert "world sizes that disagree" in err and "model_world_size_4_rank_0.pt" in err
    (actor / "model_world_size_4_rank_0.pt").unlink()
    (actor / "fsdp_config.json").write_text(json.dumps({"world_size": 8}))
    err = refused([str(checkpoint), str(tmp_path / "out")], capsys)
    assert f"{actor / 'fsdp_config.json'}: world_size 8" in err


def test_a_missing_huggingface_config_is_named(verl_checkpoint: tuple[Path, Path],
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    checkpoint = copy_of(verl_checkpoint[0], tmp_path)
    (checkpoint / "actor" / "huggingface" / "config.json").unlink()
    err = refused([str(checkpoint), str(tmp_path / "out")], capsys)
    assert f"{checkpoint / 'actor' / 'huggingface' / 'config.json'}: missing" in err


def test_shards_whose_keys_differ_are_named(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    torch.save({"a": torch.zeros(2)}, tmp_path / "model_world_size_2_rank_0.pt")
    torch.save({"b": torch.zeros(2)}, tmp_path / "model_world_size_2_rank_1.pt")
    (tmp_path / "huggingface").mkdir()
    LlamaConfig().save_pretrained(tmp_path / "huggingface")
    err = refused([str(tmp_path), str(tmp_path / "out")], capsys)
    assert "model_world_size_2_rank_1.pt: its keys differ" in err and "a, b" in err


def test_a_folder_without_shards_the_optimizer_and_an_out_dir_in_use_are_refused(
        verl_checkpoint: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    err = refused([str(tmp_path), str(tmp_path / "out")], capsys)
    assert f"{tmp_path}: no model_world_size_W_rank_R.pt shards" in err
    err = refused([str(verl_checkpoint[0]), "--optimizer", str(tmp_path / "out")], capsys)
    assert "--optimizer: refused" in err and "buffer" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    err = refused([str(verl_checkpoint[0]), str(tmp_path / "mine")], capsys)
    assert "already exists" in err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
