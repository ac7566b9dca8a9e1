"""``relay import-verl``: a checkpoint in verl's 2-rank FSDP layout (``actor/`` and ``critic/``,
each ``model_world_size_2_rank_{0,1}.pt`` of DTensor shards saved by a real 2-rank gloo run,
``huggingface/`` with config and tokenizer) becomes Hugging Face folders whose tensors equal
the models saved; replicated DTensors (checked equal) and an HSDP ``("ddp", "fsdp")`` mesh
merge too, plain-tensor shards on dim 0; missing ranks, disagreeing world sizes,
a missing ``huggingface/config.json``, shards whose keys differ and an OUT_DIR in use each
exit 2 with a message naming the file, writing nothing. With ``--optimizer`` the AdamW
state of FSDP2's DTensor shards and of FSDP1's flat parameters (a real 2-rank FSDP1 run)
equals the whole state torch gathers; shards that do not fit are named."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from relay.import_verl import VerlImportError, main, merge_shards
from relay.learner.imported_optimizer import MOMENTS, moment_file, read_adamw_meta

from ...conftest import exit_worker, free_port, save_random_model


def critic_model(model_dir: Path) -> torch.nn.Module:
    """verl's critic: the model's body under a one-label token-classification head."""
    torch.manual_seed(1)
    config = LlamaConfig.from_pretrained(model_dir, num_labels=1)
    return AutoModelForTokenClassification.from_config(config)


def one_adamw_step(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW after one step on a fixed batch (the same on every rank)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(12).reshape(2, 6) % 20 + 3
    output = model(input_ids=ids)
    output.logits.float().square().mean().backward()
    optimizer.step()
    return optimizer


def save_like_verl(rank: int, port: int, model_dir: Path, folder: Path) -> None:
    """One rank of a 2-rank FSDP2 run saving as verl's ``FSDPCheckpointManager`` does, and of
    an FSDP1 one (verl's default: ``use_orig_params=False``, a unit per decoder layer). The
    model shards hold the weights it started from (their round trip is checked against the
    original); the optimizer shards hold AdamW after one step, and ``reference_optim.pt``
    its whole state by parameter name (torch's ``get_optimizer_state_dict``)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    for part, model in (("actor", AutoModelForCausalLM.from_pretrained(model_dir)),
                        ("critic", critic_model(model_dir))):
        out = folder / part
        fully_shard(model, mesh=mesh)
        torch.save(model.state_dict(), out / f"model_world_size_2_rank_{rank}.pt")
        save_optimizer(model, one_adamw_step(model), out, rank)
    fsdp1 = FSDP(AutoModelForCausalLM.from_pretrained(model_dir), device_mesh=mesh,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}),
                 use_orig_params=False, device_id=torch.device("cpu"))
    optimizer = one_adamw_step(fsdp1)
    with FSDP.state_dict_type(fsdp1, StateDictType.SHARDED_STATE_DICT):
        torch.save(fsdp1.state_dict(), folder / "fsdp1" / f"model_world_size_2_rank_{rank}.pt")
    save_optimizer(fsdp1, optimizer, folder / "fsdp1", rank)
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ddp", "fsdp"))
    torch.save({"replicated": distribute_tensor(MERGED["replicated"], mesh, [Replicate()]),
                "hsdp": distribute_tensor(MERGED["hsdp"], hsdp, [Replicate(), Shard(1)])},
               folder / "other" / f"model_world_size_2_rank_{rank}.pt")
    dist.destroy_process_group()
    exit_worker()


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path,
                   rank: int) -> None:
    """The rank's raw ``optimizer.state_dict()`` as verl saves it, and the whole state."""
    torch.save(optimizer.state_dict(), out / f"optim_world_size_2_rank_{rank}.pt")
    whole = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(whole["state"], out / "reference_optim.pt")


MERGED = {"replicated": torch.arange(6.0).reshape(2, 3),
          "hsdp": torch.arange(15.0).reshape(3, 5)}  # sharded on dim 1, unevenly


@pytest.fixture(scope="module")
def verl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``global_step_1/`` as verl writes it from two ranks, and the model it started from."""
    root = tmp_path_factory.mktemp("verl")
    model_dir = save_random_model(root / "model", hidden=64)
    checkpoint = root / "global_step_1"
    for part in ("actor", "critic", "fsdp1"):
        hf = checkpoint / part / "huggingface"
        hf.mkdir(parents=True)
        LlamaConfig.from_pretrained(model_dir).save_pretrained(hf)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(hf)
        (checkpoint / part / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 1 if part == "fsdp1" else 2, "world_size": 2}))
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


def test_a_folder_without_shards_and_an_out_dir_in_use_are_refused(
        verl_checkpoint: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    err = refused([str(tmp_path), str(tmp_path / "out")], capsys)
    assert f"{tmp_path}: no model_world_size_W_rank_R.pt shards" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    err = refused([str(verl_checkpoint[0]), str(tmp_path / "mine")], capsys)
    assert "already exists" in err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("part, out_part", [("actor", "."), ("critic", "critic"),
                                            ("fsdp1", ".")])
def test_adamw_state_of_two_ranks_is_put_together_by_parameter_name(
        verl_checkpoint: tuple[Path, Path], tmp_path: Path, part: str, out_part: str) -> None:
    """FSDP2's DTensor moments (actor, critic) and FSDP1's flat-parameter chunks equal the
    whole state torch gathers, under the model's parameter names, with Adam's step."""
    checkpoint = verl_checkpoint[0]
    source = checkpoint if part == "critic" else checkpoint / part
    assert main([str(source), "--optimizer", str(tmp_path / "out")]) == 0
    folder = tmp_path / "out" / out_part / "optimizer"
    meta = read_adamw_meta(folder, "key")
    moments = {moment: load_file(moment_file(folder, moment)) for moment in MOMENTS}
    reference = torch.load(checkpoint / part / "reference_optim.pt", weights_only=True)
    assert meta.step == 1 and meta.hyperparameters["lr"] == 1e-3
    assert f"{source.name}" in meta.source and "2 ranks" in meta.source
    for moment in ("exp_avg", "exp_avg_sq"):
        assert moments[moment].keys() == reference.keys()
        for name, state in reference.items():
            assert torch.equal(moments[moment][name], state[moment]), (moment, name)
            assert moments[moment][name].abs().sum() > 0, (moment, name)  # it stepped


def test_optimizer_shards_that_do_not_fit_the_model_are_named(
        verl_checkpoint: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    checkpoint = copy_of(verl_checkpoint[0], tmp_path)
    fsdp1 = checkpoint / "fsdp1"
    for rank in range(2):  # as another wrap policy would cut the first flat parameter
        path = fsdp1 / f"optim_world_size_2_rank_{rank}.pt"
        state = torch.load(path, weights_only=True)
        state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"][:-1]
        torch.save(state, path)
    err = refused([str(fsdp1), "--optimizer", str(tmp_path / "out")], capsys)
    assert "exp_avg of flat parameter 0 (model.embed_tokens.weight ...)" in err
    assert "wrapped the model otherwise" in err and not (tmp_path / "out").exists()
    (checkpoint / "actor" / "optim_world_size_2_rank_1.pt").unlink()
    err = refused([str(checkpoint), "--optimizer", str(tmp_path / "out")], capsys)
    assert f"{checkpoint / 'actor' / 'optim_world_size_2_rank_1.pt'}: missing" in err
