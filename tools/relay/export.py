"""Write a model of a run's checkpoint as a Hugging Face model folder.

    relay export RUN_DIR/checkpoints/step-N [--dtype D] [--critic | --prm | --merge-lora] OUT_DIR
    relay export RUN_DIR [--step N] [--dtype D] [--critic | --prm | --merge-lora] OUT_DIR

The source is a checkpoint folder, or a run directory: its newest complete checkpoint
(``--step N``: checkpoint ``step-N``). A checkpoint that fails its integrity check
(``relay.learner.checkpoint_meta.check_intact``: owner and mode, the SHA-256 of every file,
the DCP metadata) is refused. OUT_DIR gets, in ``--dtype`` (default: the run's
``model.dtype`` when the checkpoint lies in a run directory, else float32, as checkpoints
hold it), safetensors weights (``model.safetensors``, or shards and
``model.safetensors.index.json``), ``config.json`` saying the dtype, and the policy's
tokenizer files:

- by default the policy (``AutoModelForCausalLM``, with ``generation_config.json``): the
  checkpoint's ``hf/`` folder cast to the dtype;
- ``--critic``: PPO's critic (``relay.learner.critic.ValueModel``, read from the checkpoint's
  DCP state) as ``AutoModelForTokenClassification`` with ``num_labels = 1``, verl's critic
  layout: the body under the architecture's base-model prefix, the value head as ``score``
  (``relay.learner.hf_export.value_model_as_token_classification``); its config is that of
  ``critic.model.path`` (else the policy's); a LoRA critic's adapters are merged,
  W + (alpha / r) B A, with alpha / r of the checkpoint's ``critic_adapter/``
  (``relay.learner.lora.merged_state``);
- ``--prm``: PRIME's implicit PRM (``relay.learner.implicit_prm``), a causal LM, with the
  config of ``reward_model.model.path`` (else the policy's);
- ``--merge-lora``: the policy with its LoRA adapters merged into the base weights.

OUT_DIR is written atomically and must not exist yet or be empty. The policy at the end of
a run is already in ``RUN_DIR/final/``. Every problem (a source that is neither a run
directory nor a checkpoint, no such checkpoint, a damaged one, a part the checkpoint does
not hold, weights that do not fit their config, an OUT_DIR in use) exits 2 with a message
naming it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING

from relay.configs import ConfigError
from relay.configs.rundir import (FINAL_MODEL, RESOLVED_RUN, RunContext, configure_logging,
                                  is_run_dir, load_run_dir)
from relay.learner.checkpoint_files import CheckpointError
from relay.learner.checkpoint_meta import (
    META_FILE,
    CheckpointMeta,
    check_intact,
    newest_first,
    read_meta,
    scan_checkpoints,
)
from relay.learner.hf_export import (
    StateMismatch,
    convert_folder,
    read_part,
    value_model_as_token_classification,
    write_state,
)

DTYPES = ("float32", "bfloat16", "float16")
CHECKPOINT_DTYPE = "float32"  # what a checkpoint's hf/ and dcp/ hold
ADAPTER_CONFIG = Path("adapter") / "adapter_config.json"  # a LoRA run's adapters
CRITIC_ADAPTER_FOLDER = "critic_adapter"  # a LoRA critic's (relay.learner.checkpoint's)


class ExportError(Exception):
    """Why nothing was exported: the message names the run directory, step or folder."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relay export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="RUN_DIR|CHECKPOINT", type=Path,
                        help="a run directory, or one of its checkpoints "
                             "(RUN_DIR/checkpoints/step-N)")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path,
                        help="the folder to write (new, or empty)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="of a run directory: the checkpoint of step N (default: the "
                             "newest complete one)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the weights' dtype (default: the run's model.dtype, or "
                             "float32 for a checkpoint outside a run directory)")
    part = parser.add_argument_group("which model (default: the policy)")
    which = part.add_mutually_exclusive_group()
    which.add_argument("--critic", action="store_true",
                       help="PPO's critic, as AutoModelForTokenClassification (num_labels=1)")
    which.add_argument("--prm", action="store_true",
                       help="PRIME's implicit process reward model (a causal LM)")
    which.add_argument("--merge-lora", action="store_true",
                       help="the policy with its LoRA adapters merged into the base weights")
    return parser.parse_args(argv)


def pick_checkpoint(checkpoints: Path, step: int | None) -> tuple[Path, CheckpointMeta]:
    """Checkpoint ``step-<step>`` of ``checkpoints`` (None: the newest complete one), with
    its meta; ``ExportError`` naming the folder and the steps there are otherwise."""
    if step is None:
        complete = newest_first(checkpoints)
        if not complete:
            raise ExportError(f"{checkpoints}: no complete checkpoint (a run saves them every "
                              f"trainer.save_freq steps; its final policy is in "
                              f"{checkpoints.parent / FINAL_MODEL})")
        return complete[0]
    path = checkpoints / f"step-{step}"
    try:
        return path, read_meta(path)
    except CheckpointError as exc:
        steps = [found for found, _path in scan_checkpoints(checkpoints)[0]]
        there = ", ".join(map(str, steps)) if steps else "none"
        raise ExportError(f"step {step}: {exc} (complete checkpoints of steps: {there})") from exc


def owning_run(checkpoint: Path) -> RunContext | None:
    """The run directory whose checkpoint dir holds ``checkpoint`` (the default
    ``RUN_DIR/checkpoints/step-N``), or None."""
    run_dir = checkpoint.parent.parent
    if not is_run_dir(run_dir):
        return None
    ctx = load_run_dir(run_dir)
    return ctx if ctx.checkpoint_dir.resolve() == checkpoint.parent.resolve() else None


def resolve_source(source: Path, step: int | None
                   ) -> tuple[Path, CheckpointMeta, RunContext | None]:
    """The checkpoint ``source`` names (a run directory and ``step``, or a checkpoint
    folder), its meta and its run (None when it lies in no run directory)."""
    if is_run_dir(source):
        ctx = load_run_dir(source)
        return (*pick_checkpoint(ctx.checkpoint_dir, step), ctx)
    if not (source / META_FILE).is_file():
        raise ExportError(f"{source}: not a run directory (no {RESOLVED_RUN}) nor a "
                          f"checkpoint (no {META_FILE})")
    if step is not None:
        raise ExportError(f"--step {step}: {source} is a checkpoint already; --step picks "
                          "one of a run directory")
    try:
        meta = read_meta(source)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    return source, meta, owning_run(source)


def part_config(model_path: str, policy_hf: Path, key: str) -> PretrainedConfig:
    """The config of a part loaded from ``model_path`` (the run's ``key``), or, when that
    is empty (the part started from the policy), of the policy in ``policy_hf``."""
    source = model_path or str(policy_hf)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{key} = {source!r}: its config does not load ({exc}); the "
                          "exported model takes its architecture from there") from exc


def check_part(checkpoint: Path, meta: CheckpointMeta, part: str, flag: str) -> None:
    if part not in meta.parts:
        raise ExportError(f"{checkpoint} holds no {part} (its trained parts: "
                          f"{', '.join(meta.parts)}), so {flag} has nothing to export")


def export_critic(checkpoint: Path, meta: CheckpointMeta, ctx: RunContext | None,
                  out_dir: Path, dtype: torch.dtype) -> str:
    check_part(checkpoint, meta, "critic", "--critic")
    config = part_config(ctx.run.critic.model.path if ctx else "", checkpoint / "hf",
                         "critic.model.path")
    config.num_labels = 1
    model_class = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING.get(type(config), None)
    if model_class is None:
        raise ExportError(f"{checkpoint}: the critic's architecture "
                          f"{type(config).__name__} has no ...ForTokenClassification class "
                          "in transformers, the layout --critic writes")
    state = read_part(checkpoint / "dcp", "critic.model.")
    if (checkpoint / CRITIC_ADAPTER_FOLDER).is_dir():
        from relay.learner.lora import adapter_scale, merged_state  # peft: the lora extra
        state = merged_state(state, adapter_scale(checkpoint / CRITIC_ADAPTER_FOLDER))
    state = value_model_as_token_classification(state, model_class.base_model_prefix)
    write_state(state, config, AutoModelForTokenClassification, out_dir, dtype,
                files_from=checkpoint / "hf")
    return f"the critic ({model_class.__name__}, num_labels=1)"


def export_prm(checkpoint: Path, meta: CheckpointMeta, ctx: RunContext | None,
               out_dir: Path, dtype: torch.dtype) -> str:
    check_part(checkpoint, meta, "prm", "--prm")
    config = part_config(ctx.run.reward_model.model.path if ctx else "", checkpoint / "hf",
                         "reward_model.model.path")
    write_state(read_part(checkpoint / "dcp", "prm.model."), config, AutoModelForCausalLM,
                out_dir, dtype, files_from=checkpoint / "hf")
    return "the implicit PRM"


def export_merged_lora(checkpoint: Path, ctx: RunContext | None, out_dir: Path,
                       dtype: torch.dtype) -> str:
    """The base model (the run's ``model.path``, else the adapter's recorded base) with the
    checkpoint's adapters merged (``relay.learner.lora.write_merged``)."""
    if not (checkpoint / ADAPTER_CONFIG).is_file():
        raise ExportError(f"{checkpoint}: --merge-lora: holds no LoRA adapters (no "
                          f"{ADAPTER_CONFIG}; a run with model.lora_rank > 0 writes them)")
    from relay.learner.lora import write_merged  # peft: the lora extra
    try:
        write_merged(checkpoint / ADAPTER_CONFIG.parent, out_dir, dtype,
                     base_path=ctx.run.model.path if ctx else None,
                     tokenizer_from=checkpoint / "hf")
    except ValueError as exc:
        raise ExportError(f"{checkpoint}: --merge-lora: {exc}") from exc
    return "the policy with its LoRA adapters merged"


def export(source: Path, out_dir: Path, step: int | None = None, dtype: str | None = None,
           part: str = "policy") -> tuple[Path, str]:
    """Write ``part`` ("policy", "critic", "prm" or "merged-lora") of the checkpoint
    ``source`` names (``resolve_source``) into ``out_dir`` in ``dtype`` (None: the run's
    ``model.dtype``, else float32); the checkpoint it took and what it wrote, in words."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: already exists and is not an empty folder; "
                          "name a new one")
    checkpoint, meta, ctx = resolve_source(source, step)
    try:
        check_intact(checkpoint, meta)
    except CheckpointError as exc:
        raise ExportError(f"{checkpoint} is damaged, not exported: {exc}") from exc
    hf = checkpoint / "hf"
    if not (hf / "config.json").is_file():
        raise ExportError(f"{checkpoint}: holds no Hugging Face folder hf/")
    torch_dtype = getattr(torch, dtype or (ctx.run.model.dtype if ctx else CHECKPOINT_DTYPE))
    try:
        if part == "critic":
            return checkpoint, export_critic(checkpoint, meta, ctx, out_dir, torch_dtype)
        if part == "prm":
            return checkpoint, export_prm(checkpoint, meta, ctx, out_dir, torch_dtype)
    except (StateMismatch, CheckpointError) as exc:
        raise ExportError(f"{checkpoint}: {part}: {exc}") from exc
    if part == "merged-lora":
        return checkpoint, export_merged_lora(checkpoint, ctx, out_dir, torch_dtype)
    convert_folder(hf, out_dir, torch_dtype)
    return checkpoint, "the policy"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    part = ("critic" if args.critic else "prm" if args.prm
            else "merged-lora" if args.merge_lora else "policy")
    try:
        checkpoint, what = export(args.source.resolve(), args.out_dir, args.step, args.dtype,
                                  part)
    except (ExportError, ConfigError) as exc:
        print(f"relay export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {what} of {checkpoint} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
