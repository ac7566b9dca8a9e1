"""Turn a verl FSDP checkpoint into Hugging Face model folders.

    relay import-verl VERL_CHECKPOINT OUT_DIR [--dtype DTYPE]

VERL_CHECKPOINT is what verl's ``FSDPCheckpointManager`` writes: a ``global_step_N`` folder
with ``actor/`` (and ``critic/`` when PPO trained one), or one such folder itself. Each holds
``model_world_size_W_rank_R.pt`` for every rank R < W (the rank's ``model.state_dict()``
under FSDP's sharded state dict), ``huggingface/`` (the model's config, generation config
and tokenizer), ``optim_world_size_W_rank_R.pt`` (read with ``--optimizer``),
``extra_state_*`` shards (the schedule and RNG, unused here) and ``fsdp_config.json``.

Merging. The shards are read with ``torch.load(weights_only=True)``: DTensors and plain
tensors load, nothing in them runs code. A DTensor's rank-local tensors are put together by
its placements over its device mesh: along a ``Shard(d)`` mesh dimension they are
concatenated on dim d in mesh order (uneven shards as ``torch.chunk`` cuts them); along a
``Replicate`` one the first index is taken (HSDP's ``("ddp", "fsdp")`` mesh: the first
replica group), and a tensor replicated over every rank is checked equal on all of them;
the result must have the DTensor's global shape. A plain tensor is concatenated on dim 0
across the ranks, as verl's ``model_merger`` does. Meshes with more than one sharded
dimension (tensor parallelism) and ``Partial`` placements are refused.

Output. The actor goes to OUT_DIR as ``AutoModelForCausalLM``, the critic to
``OUT_DIR/critic`` as ``AutoModelForTokenClassification`` (verl's critic: a ``score`` head
with one label), each with ``save_pretrained``'s safetensors (sharded with an index past
1 GiB), its ``huggingface/`` config (saying the dtype), generation config and tokenizer
(``relay.learner.hf_export.write_state``), in ``--dtype`` (default: the shards' own). OUT_DIR
is then a ``model.path`` for a Relay run, and the critic folder a ``critic.model.path``.

``--optimizer`` also writes each model's AdamW state, put together by parameter name from
verl's ``optim_world_size_W_rank_R.pt`` shards (FSDP2's DTensors, or FSDP1's flat
parameters under verl's default wrap policy: ``relay.verl_shards``), into
``OUT_DIR/optimizer`` (``OUT_DIR/critic/optimizer``; ``relay.learner.imported_optimizer``).
A Relay run started from OUT_DIR with ``actor.optim.state_path=OUT_DIR/optimizer`` (and
``critic.optim.state_path=OUT_DIR/critic/optimizer``) continues with verl's Adam moments and
step count instead of fresh ones. It is a warm start, not verl's resume: Relay's own
``relay launch --resume RUN_DIR`` needs a Relay checkpoint (the buffer's prompt stream, every
rank's random state, the run's lineage), which a verl checkpoint does not have, and the
learning-rate schedule starts at this run's step 0.

Every problem (no shards, ranks missing, world sizes that disagree, no
``huggingface/config.json``, shards whose keys differ, weights that do not fit the config,
an OUT_DIR in use) exits 2 with a message naming the file.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401  (torch.load needs it to build DTensors)
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from relay.configs.rundir import configure_logging
from relay.dtensor_merge import merge_dtensor
from relay.learner.hf_export import StateMismatch, write_state
from relay.learner.imported_optimizer import FOLDER as OPTIMIZER_FOLDER
from relay.learner.imported_optimizer import write_adamw_state
from relay.verl_shards import VerlImportError, import_adamw, meta_model, read_shard

DTYPES = ("float32", "bfloat16", "float16")
SHARD_PATTERN = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")
HF_FOLDER = "huggingface"
FSDP_CONFIG = "fsdp_config.json"
PARTS = ("actor", "critic")  # verl's subfolders, in the order they are written
CRITIC_FOLDER = "critic"  # under OUT_DIR
VALUE_HEAD = "score.weight"  # what makes a state a critic's (AutoModelForTokenClassification)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relay import-verl",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", metavar="VERL_CHECKPOINT", type=Path,
                        help="verl's global_step_N folder (with actor/, critic/) or one of them")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path,
                        help="the folder to write (new, or empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the weights' dtype (default: the shards' own)")
    parser.add_argument("--optimizer", action="store_true",
                        help="also write AdamW's state into OUT_DIR/optimizer (and "
                             "OUT_DIR/critic/optimizer), for actor.optim.state_path")
    return parser.parse_args(argv)


def find_parts(checkpoint: Path) -> dict[str, Path]:
    """The sharded models of ``checkpoint``: {"actor": ..., "critic": ...} of a
    ``global_step_N`` folder, or {"actor": checkpoint} of one holding shards itself."""
    if not checkpoint.is_dir():
        raise VerlImportError(f"{checkpoint}: no such folder")
    parts = {part: checkpoint / part for part in PARTS if (checkpoint / part).is_dir()}
    if parts:
        if "actor" not in parts:
            raise VerlImportError(f"{checkpoint}: has critic/ but no actor/")
        return parts
    if any(SHARD_PATTERN.fullmatch(path.name) for path in checkpoint.iterdir()):
        return {"actor": checkpoint}
    raise VerlImportError(f"{checkpoint}: no model_world_size_W_rank_R.pt shards, nor actor/ "
                       "or critic/ folders holding them (a verl FSDP checkpoint, "
                       "global_step_N/, has them)")


def is_verl_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a verl FSDP checkpoint (``find_parts`` finds one)."""
    try:
        find_parts(path)
    except VerlImportError:
        return False
    return True


def shard_paths(folder: Path) -> list[Path]:
    """``model_world_size_W_rank_R.pt`` of ranks 0..W-1 of ``folder``, in rank order; an
    ``VerlImportError`` naming the files when their world sizes disagree (with each other or
    with ``fsdp_config.json``) or a rank is missing."""
    found: dict[int, dict[int, Path]] = {}
    for path in folder.iterdir():
        match = SHARD_PATTERN.fullmatch(path.name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = path
    if not found:
        raise VerlImportError(f"{folder}: no model_world_size_W_rank_R.pt shards")
    if len(found) > 1:
        sizes = "; ".join(f"world size {size}: {', '.join(sorted(p.name for p in ranks.values()))}"
                          for size, ranks in sorted(found.items()))
        raise VerlImportError(f"{folder}: shards of world sizes that disagree ({sizes})")
    (world, ranks), = found.items()
    missing = [f"model_world_size_{world}_rank_{rank}.pt" for rank in range(world)
               if rank not in ranks]
    if missing:
        raise VerlImportError(f"{folder}: missing rank{'s' * (len(missing) > 1)} of world size "
                           f"{world}: {', '.join(missing)}")
    beyond = sorted(path.name for rank, path in ranks.items() if rank >= world)
    if beyond:
        raise VerlImportError(f"{folder}: shards of ranks beyond world size {world}: "
                           f"{', '.join(beyond)}")
    fsdp_config = folder / FSDP_CONFIG
    if fsdp_config.is_file():
        recorded = json.loads(fsdp_config.read_text(encoding="utf-8")).get("world_size")
        if recorded is not None and recorded != world:
            raise VerlImportError(f"{fsdp_config}: world_size {recorded}, but the shards are of "
                               f"world size {world}")
    return [ranks[rank] for rank in range(world)]


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """One rank's state dict (``read_shard``: no code in it runs)."""
    state = read_shard(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VerlImportError(f"{path}: not a state dict of tensors")
    return state


def merge_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The full state dict of one verl model from its rank shards (``shard_paths``)."""
    shards = [load_shard(path) for path in paths]
    keys = set(shards[0])
    for path, shard in zip(paths[1:], shards[1:]):
        if set(shard) != keys:
            differ = sorted(keys.symmetric_difference(shard))
            raise VerlImportError(f"{path}: its keys differ from {paths[0].name}'s: "
                               f"{', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}")
    state: dict[str, torch.Tensor] = {}
    for name in sorted(keys):
        pieces = [shard.pop(name) for shard in shards]
        try:
            if all(isinstance(piece, DTensor) for piece in pieces):
                state[name] = merge_dtensor(name, pieces)
            elif any(isinstance(piece, DTensor) for piece in pieces):
                raise StateMismatch(f"{name}: a DTensor on some ranks, a plain tensor on others")
            else:
                state[name] = torch.cat(pieces, dim=0) if pieces[0].dim() else pieces[0]
        except StateMismatch as exc:
            raise VerlImportError(f"{paths[0].parent}: {exc}") from exc
    return state


def import_part(folder: Path, out: Path, dtype: str | None, optimizer: bool = False) -> str:
    """Merge ``folder``'s shards and write them into ``out`` (and, with ``optimizer``,
    AdamW's state into ``out/optimizer``); what was written, in words."""
    config_file = folder / HF_FOLDER / "config.json"
    if not config_file.is_file():
        raise VerlImportError(f"{config_file}: missing; verl writes the model's config and "
                           "tokenizer there, and the import takes the architecture from it")
    paths = shard_paths(folder)
    state = merge_shards(paths)
    try:
        config = AutoConfig.from_pretrained(str(folder / HF_FOLDER))
    except (OSError, ValueError) as exc:
        raise VerlImportError(f"{config_file}: does not load ({exc})") from exc
    auto_class = AutoModelForCausalLM
    if VALUE_HEAD in state:
        auto_class = AutoModelForTokenClassification
        config.num_labels = state[VALUE_HEAD].shape[0]
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    torch_dtype = getattr(torch, dtype) if dtype else (floating[0] if floating else torch.float32)
    adamw = None
    if optimizer:
        adamw = import_adamw(folder, len(paths), meta_model(config, auto_class),
                             source=f"verl {folder.parent.name}/{folder.name} "
                                    f"({len(paths)} ranks)")
    try:
        write_state(state, config, auto_class, out, torch_dtype, files_from=folder / HF_FOLDER)
    except StateMismatch as exc:
        raise VerlImportError(f"{folder}: {exc}") from exc
    said = f"{auto_class.__name__} ({str(torch_dtype).removeprefix('torch.')})"
    if adamw is not None:
        write_adamw_state(out / OPTIMIZER_FOLDER, adamw[1], adamw[0])
        said += f", AdamW state at step {adamw[0].step} in {out / OPTIMIZER_FOLDER}"
    return said


def import_verl(checkpoint: Path, out_dir: Path, dtype: str | None = None,
                optimizer: bool = False) -> list[str]:
    """Write the actor of ``checkpoint`` into ``out_dir`` and its critic, if any, into
    ``out_dir/critic`` (with ``optimizer``, each with its AdamW state); lines saying what
    went where. Nothing is left on failure."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise VerlImportError(f"{out_dir}: already exists and is not an empty folder; "
                           "name a new one")
    parts = find_parts(checkpoint)
    for folder in parts.values():
        shard_paths(folder)  # every part's files are in place before anything is written
    lines = []
    try:
        for part, out in (("actor", out_dir), ("critic", out_dir / CRITIC_FOLDER)):
            if part in parts:
                lines.append(f"{parts[part]} -> {out}: "
                             f"{import_part(parts[part], out, dtype, optimizer)}")
    except VerlImportError:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    try:
        lines = import_verl(args.checkpoint.resolve(), args.out_dir, args.dtype,
                            optimizer=args.optimizer)
    except VerlImportError as exc:
        print(f"relay import-verl: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
