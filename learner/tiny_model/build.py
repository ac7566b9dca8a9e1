"""Build Relay's embedded default model: tokenizer, seeded init, warm start, save, measure.

``build_tiny_model`` writes a directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load (weights, config, tokenizer with chat template,
generation config with eos/pad), then measures it on the shipped test file
(``configs/data/arithmetic-test.jsonl``) with ``evaluate.evaluate_model_dir``.

The same seed gives bit-identical weights on the same machine and torch build: the
tokenizer does not depend on the seed, the init is seeded, and the warm start draws its
data from the seeded stream. The directory is assembled under a temporary name and renamed
into place, so a crashed build never leaves a half-written model behind.

``build_tools_model`` builds the tool-using variant (``builtin:tiny-arith-tools``) the same
way: the same architecture, its own tokenizer (``tokenizer.build_tools_tokenizer``) and
warm start (``tool_warm_start``), measured with its tool calls executed
(``tool_evaluate``) on ``configs/data/arithmetic-tools-test.jsonl``.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import load_prompt_rows
from relay.learner.tiny_model.evaluate import evaluate_model_dir
from relay.learner.tiny_model.tokenizer import build_tokenizer, build_tools_tokenizer
from relay.learner.tiny_model.tool_evaluate import (
    ToolModelAccuracy,
    ToolRunner,
    evaluate_tool_model_dir,
)
from relay.learner.tiny_model.tool_warm_start import ToolWarmStartConfig, tool_warm_start
from relay.learner.tiny_model.warm_start import StepCallback, WarmStartConfig, warm_start

TEST_FILE = CONFIG_DIR / "data" / "arithmetic-test.jsonl"
TOOLS_TEST_FILE = CONFIG_DIR / "data" / "arithmetic-tools-test.jsonl"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Architecture and init of the tiny Llama (defaults: ~0.69M parameters).

    Measured on the warm start, 2 CPU threads: two layers of eight narrow heads learn this
    task several times faster per step than 3-4 layers of fewer heads or a 256-wide model,
    and an init std of 0.06 (Hugging Face's default is 0.02) leaves the early plateau sooner.
    """

    hidden_size: int = 128
    layers: int = 2
    heads: int = 8
    head_dim: int = 32
    """Per head, set explicitly rather than ``hidden_size // heads`` (16): vLLM's CPU
    attention runs head_dim 32 and up, so q/k/v project 128 -> 256 and o 256 -> 128.
    Measured (seed 0, default warm start, 300 test problems): 8 heads of 32 reach 24.3%
    greedy (pass@8 41.7%), 8 of 16 (recipe r2) 14.0% (34.0%), 4 of 32 only 4.0% (10.7%)."""
    intermediate_size: int = 512
    max_positions: int = 256
    init_std: float = 0.06


@dataclass(frozen=True)
class BuildReport:
    """What ``build_tiny_model`` made and how good it is on the held-out test problems."""

    path: Path
    params: int
    seconds: float  # whole build: tokenizer, warm start, save and evaluation
    warm_start_steps: int
    warm_start_seconds: float
    final_loss: float  # mean response-token loss over the last warm-start steps
    eval_problems: int
    heldout_accuracy: float  # greedy
    k: int  # samples per problem behind pass_at_1 / pass_at_k
    pass_at_1: float
    pass_at_k: float


@dataclass(frozen=True)
class ToolBuildReport:
    """What ``build_tools_model`` made and how it does on the held-out problems, tools run."""

    path: Path
    params: int
    seconds: float  # whole build: tokenizer, warm start, save and evaluation
    warm_start_steps: int
    warm_start_seconds: float
    final_loss: float  # mean response-token loss over the last warm-start steps
    heldout: ToolModelAccuracy


RECIPE_VERSION = 3
"""Bump whenever the tokenizer, architecture or warm start changes: it names the cache."""
TOOLS_RECIPE_VERSION = 1
"""The same for the tool-using variant."""
BUILTIN_RECIPES: dict[str, int] = {"tiny-arith": RECIPE_VERSION,
                                   "tiny-arith-tools": TOOLS_RECIPE_VERSION}
"""Each ``builtin:`` model's name and recipe version (``relay.configs.checks.BUILTIN_MODELS``
lists the same names)."""


def default_model_dir(name: str = "tiny-arith") -> Path:
    """Where the launcher caches the built model ``name``:
    ``$XDG_CACHE_HOME/relay/models/tiny-arith-r3`` (``tiny-arith-tools-r1``).

    The recipe version is part of the name, so a cache built by an older recipe is never
    mistaken for the current model. Raises ``ValueError`` for a name not in
    ``BUILTIN_RECIPES``.
    """
    if name not in BUILTIN_RECIPES:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_RECIPES)}")
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "relay" / "models" / f"{name}-r{BUILTIN_RECIPES[name]}"


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    *,
    warm_start_steps: int = WarmStartConfig.steps,
    spec: ModelSpec = ModelSpec(),
    eval_limit: int | None = None,
    eval_k: int = 8,
    overwrite: bool = False,
    on_step: StepCallback | None = None,
) -> BuildReport:
    """Build, save and measure the tiny arithmetic model in ``out_dir``.

    ``eval_limit`` evaluates only the first rows of the test file and ``eval_k`` sets the
    samples per problem behind pass@k (both small for quick builds in tests).
    ``on_step(step, loss)`` reports warm-start progress. Raises ``FileExistsError`` if
    ``out_dir`` exists and ``overwrite`` is false, or if it is a non-empty directory that
    holds no model (``overwrite`` replaces model directories, nothing else).
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    _check_replaceable(out_dir, overwrite)
    rows = load_prompt_rows(TEST_FILE)[:eval_limit]

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(spec, tokenizer))
    trained = warm_start(
        model, tokenizer, WarmStartConfig(steps=warm_start_steps, seed=seed), on_step=on_step
    )
    _save(model, tokenizer, out_dir)

    measured = evaluate_model_dir(out_dir, rows, k=eval_k, seed=seed)
    return BuildReport(
        path=out_dir,
        params=sum(p.numel() for p in model.parameters()),
        seconds=time.perf_counter() - started,
        warm_start_steps=trained.steps,
        warm_start_seconds=trained.seconds,
        final_loss=trained.final_loss,
        eval_problems=measured.problems,
        heldout_accuracy=measured.greedy_accuracy,
        k=measured.k,
        pass_at_1=measured.pass_at_1,
        pass_at_k=measured.pass_at_k,
    )


def build_tools_model(
    out_dir: str | os.PathLike[str],
    run_tool: ToolRunner,
    seed: int = 0,
    *,
    recipe: ToolWarmStartConfig = ToolWarmStartConfig(),
    spec: ModelSpec = ModelSpec(),
    eval_limit: int | None = None,
    eval_k: int = 8,
    overwrite: bool = False,
    on_step: StepCallback | None = None,
) -> ToolBuildReport:
    """Build, save and measure the tool-using variant in ``out_dir``; ``run_tool`` runs the
    calculator in the measurement (``tool_evaluate``). ``recipe.optim.seed`` is replaced by
    ``seed``; the rest as ``build_tiny_model``."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    _check_replaceable(out_dir, overwrite)
    rows = load_prompt_rows(TOOLS_TEST_FILE)[:eval_limit]

    tokenizer = build_tools_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(spec, tokenizer))
    recipe = replace(recipe, optim=replace(recipe.optim, seed=seed))
    trained = tool_warm_start(model, tokenizer, recipe, on_step=on_step)
    _save(model, tokenizer, out_dir)

    heldout = evaluate_tool_model_dir(out_dir, rows, run_tool, k=eval_k, seed=seed)
    return ToolBuildReport(
        path=out_dir,
        params=sum(p.numel() for p in model.parameters()),
        seconds=time.perf_counter() - started,
        warm_start_steps=trained.steps,
        warm_start_seconds=trained.seconds,
        final_loss=trained.final_loss,
        heldout=heldout,
    )


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Save with eos/pad in the generation config, under a temporary name renamed into place."""
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial, save_jinja_files=False)  # template in tokenizer_config.json
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)


def _check_replaceable(out_dir: Path, overwrite: bool) -> None:
    if not out_dir.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--force) to rebuild it")
    holds_other_things = out_dir.is_file() or (
        any(out_dir.iterdir()) and not (out_dir / "config.json").is_file()
    )
    if holds_other_things:
        raise FileExistsError(f"{out_dir} is not a model directory; refusing to replace it")


def _llama_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
