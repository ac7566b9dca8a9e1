#!/usr/bin/env python3
"""Train Relay's embedded default task with TRL's synchronous ``GRPOTrainer``: the baseline.

    tools/with-venv python tools/trl_grpo.py [--model PATH] [--steps 400] [--test-freq 10]
        [--threads 2] [--seed 0] [--eval-problems N] [--train-file F] [--test-file F]
        [--prompts-per-step 32] [--response-length 16] [--reward PATH:NAME] [--dtype float32]

Needs ``trl`` (``pip install -e '.[bench]'``). ``tools/bench-e2e.py`` runs it beside Relay's
default run. Prints one JSON object per line on stdout (everything else goes to stderr):

    {"event": "step", "step": s, "train_seconds": t, "generated_tokens": g, ...}
        after every optimizer step; ``train_seconds`` is the cumulative wall-clock of
        training without evaluation, ``generated_tokens`` the cumulative completion tokens
        (up to and including eos, no padding); also the cumulative ``completions``,
        ``prompts``, ``trained_tokens`` (prompt + completion tokens of every completion, what
        a step trains on) and ``generation_seconds`` (inside ``generate``), and this step's
        ``reward_mean``
    {"event": "eval", "step": s, "train_seconds": t, "accuracy": a}
        held-out greedy accuracy at step 0, every ``--test-freq`` steps and at the last step (never
        with ``--test-freq 0``), measured by a ``TrainerCallback`` with Relay's own evaluation
        (``relay.generators.held_out``, its torch engine around the model being trained, Relay's
        verifier); its time is not in ``train_seconds``
    {"event": "done", ...}  the summary

The work and the hyper-parameters are those of Relay's default run
(``configs/arithmetic-grpo.toml``): the same model, data, chat template and verifier; 32
prompts x 8 samples = 256 completions per optimizer step (one generation round per step,
``num_iterations`` 1), at most 16 new tokens at temperature 1 (top-p 1, top-k off); AdamW
lr 2e-4 constant without warm-up, betas (0.9, 0.999), weight decay 0, gradient norm clipped
to 1; clip epsilon 0.2 / 0.28; group-std-normalised advantages; no KL, no reference model;
fp32 on the CPU. TRL's ``loss_type="dapo"`` is Relay's ``actor.loss_agg_mode = "token-mean"``:
the per-token losses summed over the whole 256-completion batch and divided by its number of
completion tokens (TRL's ``"grpo"`` would be Relay's ``seq-mean-token-mean``, ``"bnpo"`` a
token mean per micro-batch). The batch knobs: ``per_device_train_batch_size`` counts
completions per forward/backward, 64 as Relay's ``actor.ppo_micro_batch_size_per_gpu``;
``gradient_accumulation_steps`` 4 and ``generation_batch_size`` 256 (so
``steps_per_generation`` 4): every optimizer step generates 256 completions at once and
trains on them in 4 micro-batches. Where TRL cannot follow Relay: it has no dual clip
(Relay's ``clip_ratio_c`` 3), its advantage epsilon is 1e-4 (Relay's 1e-6), and it does not
cut prompts to ``max_prompt_length`` 64 (the arithmetic prompts are shorter).

The throughput benchmark (``tools/bench-e2e.py --throughput``) changes the batch
(``--prompts-per-step``), the response length, the reward (``--reward``, a custom function in
verl's signature) and the dtype (``--dtype bfloat16``: TRL's ``bf16=True``, autocast over
fp32 weights) and turns evaluation off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PrinterCallback,
                          TrainerCallback, TrainerControl, TrainerState, TrainingArguments)

from relay.algorithms.rewards.config import RewardConfig
from relay.algorithms.rewards.result import RewardItem
from relay.configs import load_run_config
from relay.algorithms.rewards.scorer import RewardScorer
from relay.configs.prompt_data import PromptRow, load_prompt_rows
from relay.generators.build import eos_and_pad
from relay.generators.held_out import evaluate
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parent.parent
RUN = load_run_config(ROOT / "configs" / "arithmetic-grpo.toml")  # Relay's default run
EVAL_PARAMS = SamplingParams(max_new_tokens=RUN.rollout.response_length,
                             temperature=RUN.rollout.val_kwargs.temperature)


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout."""
    print(json.dumps({"event": event, **fields}), flush=True)


def require_trl() -> tuple[type, type]:
    """TRL's ``GRPOConfig`` and ``GRPOTrainer``, or exit saying how to install them."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub otherwise
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        sys.exit(f"trl_grpo: TRL is not installed ({error}); install the benchmark extras "
                 "with: pip install -e '.[bench]'")
    return GRPOConfig, GRPOTrainer


def default_model() -> str:
    """The embedded default model folder, built (a few minutes) and cached on first use."""
    from relay.learner.tiny_model.build import build_tiny_model, default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        print(f"building the tiny default model into {path} (once; a few minutes)",
              file=sys.stderr, flush=True)
        build_tiny_model(path, overwrite=True)
    return str(path)


def to_trl_dataset(rows: list[PromptRow]) -> Dataset:
    """TRL's conversational format: ``prompt`` as chat messages, the reward's fields beside.

    ``extra_info`` travels as JSON text: Arrow wants one type per column, rows' dicts differ.
    """
    return Dataset.from_list([
        {"prompt": [{"role": m.role, "content": m.content} for m in row.prompt],
         "data_source": row.data_source, "ground_truth": row.reward_model.ground_truth,
         "extra_info": json.dumps(row.extra_info)}
        for row in rows])


class RelayReward:
    """Relay's verifier as a TRL reward function; counts what it is given to score.

    TRL calls it once per generation round with every completion of the round, in groups of
    ``num_generations`` samples of each prompt, and their token ids (cut after eos, no
    padding), so it also counts the prompts (distinct), completions and generated tokens.
    """

    __name__ = "relay_verifier"  # TRL names reward functions by ``__name__``

    def __init__(self, scorer: RewardScorer, tokenizer) -> None:
        self.scorer, self.tokenizer = scorer, tokenizer
        self.completions = self.prompts = self.generated_tokens = self.trained_tokens = 0
        self._prompt_tokens: dict[str, int] = {}
        self.reward_mean = float("nan")  # of the last round

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]],
                 ground_truth: list, data_source: list[str], extra_info: list[str],
                 **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        items = [RewardItem(source, text, truth, json.loads(extra))
                 for source, text, truth, extra in zip(data_source, texts, ground_truth,
                                                       extra_info, strict=True)]
        scores = [result.score for result in self.scorer.score(items)]
        self.completions += len(completions)
        self.prompts += len({repr(prompt) for prompt in prompts})
        self.generated_tokens += sum(len(ids) for ids in completion_ids)
        self.trained_tokens += sum(self.prompt_tokens(p) + len(ids)
                                   for p, ids in zip(prompts, completion_ids, strict=True))
        self.reward_mean = statistics.fmean(scores)
        return scores

    def prompt_tokens(self, prompt: list) -> int:
        """Tokens of the chat-templated prompt, as generation saw it."""
        key = repr(prompt)
        if key not in self._prompt_tokens:
            self._prompt_tokens[key] = len(self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
        return self._prompt_tokens[key]


class TimedGenerate:
    """Wraps a model's ``generate`` and adds up the seconds spent in it."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.inner, self.seconds = model.generate, 0.0
        model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - began


class Stopwatch:
    """Wall-clock since ``start``, less the intervals handed to ``pause``."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.paused_seconds = 0.0

    def start(self) -> None:
        self.started, self.paused_seconds = time.perf_counter(), 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused_seconds

    def pause(self, began: float) -> None:
        """Exclude the time from ``began`` (a ``time.perf_counter()`` reading) to now."""
        self.paused_seconds += time.perf_counter() - began


class Progress(TrainerCallback):
    """Emits the step events and measures held-out accuracy, its time kept off the clock."""

    def __init__(self, tokenizer, model_path: str, rows: list[PromptRow],
                 scorer: RewardScorer, reward: RelayReward, generate: TimedGenerate,
                 test_freq: int) -> None:
        self.tokenizer, self.rows, self.scorer, self.reward = tokenizer, rows, scorer, reward
        self.generate = generate
        self.eos, self.pad = eos_and_pad(model_path, tokenizer)
        self.test_freq = test_freq
        self.clock = Stopwatch()
        self.train_seconds = 0.0  # at the end of the last step
        self.accuracies: list[tuple[int, float, float]] = []  # (step, train seconds, accuracy)

    def accuracy(self, model: PreTrainedModel) -> float:
        """Greedy held-out accuracy of the model's current weights, in Relay's evaluation."""
        was_training = model.training
        engine = TorchEngine(model, eos_ids=self.eos, pad_id=self.pad)  # sets eval mode
        try:
            result = evaluate(engine, self.tokenizer, self.rows, self.scorer, EVAL_PARAMS,
                              n=1, max_prompt_length=RUN.data.max_prompt_length)
        finally:
            model.train(was_training)
        return result.accuracy

    def record_accuracy(self, step: int, model: PreTrainedModel) -> None:
        began = time.perf_counter()
        accuracy = self.accuracy(model)
        self.clock.pause(began)
        self.accuracies.append((step, self.train_seconds, accuracy))
        emit("eval", step=step, train_seconds=self.train_seconds, accuracy=accuracy)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                            control: TrainerControl, model: PreTrainedModel = None,
                       **_: Any) -> None:
        if self.test_freq:
            self.record_accuracy(0, model)
        self.clock.start()
        self.generate.seconds = 0.0

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, model: PreTrainedModel = None, **_: Any) -> None:
        step = state.global_step
        self.train_seconds = self.clock.seconds()
        emit("step", step=step, train_seconds=self.train_seconds,
             generated_tokens=self.reward.generated_tokens, completions=self.reward.completions,
             prompts=self.reward.prompts, trained_tokens=self.reward.trained_tokens,
             generation_seconds=self.generate.seconds, reward_mean=self.reward.reward_mean)
        if self.test_freq and (step % self.test_freq == 0 or step == state.max_steps):
            self.record_accuracy(step, model)


def grpo_config(config_class: type, args: argparse.Namespace, output_dir: str):
    """TRL's config with the knobs of Relay's default run (see the module docstring)."""
    actor, rollout, optim = RUN.actor, RUN.rollout, RUN.actor.optim
    completions = args.prompts_per_step * rollout.n
    micro = min(actor.ppo_micro_batch_size_per_gpu, completions)
    config = config_class(
        output_dir=output_dir, max_steps=args.steps, seed=args.seed, use_cpu=True,
        bf16=args.dtype == "bfloat16", fp16=False, gradient_checkpointing=False,
        # batch: prompts x samples generated per optimizer step, micro per forward/backward
        num_generations=rollout.n, generation_batch_size=completions,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro, num_iterations=1,
        # sampling
        max_completion_length=args.response_length, temperature=rollout.temperature,
        top_p=rollout.top_p, top_k=max(rollout.top_k, 0),
        # loss and advantages (token-mean is TRL's "dapo"; no KL in Relay's default run)
        loss_type="dapo", epsilon=actor.clip_ratio_low, epsilon_high=actor.clip_ratio_high,
        scale_rewards="group", beta=0.0,
        # optimizer
        optim="adamw_torch", learning_rate=optim.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], max_grad_norm=actor.grad_clip,
        # nothing else: no logging, checkpoints, completions tables or progress bars
        report_to="none", logging_strategy="no", save_strategy="no", log_completions=False,
        disable_tqdm=True, torch_compile=args.torch_compile)
    if config.steps_per_generation != config.gradient_accumulation_steps:
        raise ValueError(f"steps_per_generation {config.steps_per_generation} != "
                         f"gradient_accumulation_steps {config.gradient_accumulation_steps}: "
                         "not one generation round per optimizer step")
    return config


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face causal LM folder (default: the "
                                        "embedded tiny model, built on first use)")
    parser.add_argument("--train-file", default=RUN.data.train_files[0])
    parser.add_argument("--test-file", default=RUN.data.val_files[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--test-freq", type=int, default=10,
                        help="held-out evaluation every this many steps (and at the last); "
                             "0: none")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=0,
                        help="evaluate on the first N test problems (0: all)")
    parser.add_argument("--prompts-per-step", type=int, default=RUN.data.train_batch_size,
                        help="prompts per optimizer step (each sampled rollout.n times)")
    parser.add_argument("--response-length", type=int, default=RUN.rollout.response_length,
                        help="at most this many new tokens a completion")
    parser.add_argument("--reward", default="", metavar="PATH:NAME",
                        help="a custom reward function in verl's signature (default: the "
                             "verifier chosen by data_source)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--torch-compile", action="store_true",
                        help="TrainingArguments.torch_compile: the model under torch.compile")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.test_freq < 0 or args.eval_problems < 0:
        parser.error("--steps must be >= 1, --test-freq and --eval-problems >= 0")
    if args.prompts_per_step < 1 or args.response_length < 1:
        parser.error("--prompts-per-step and --response-length must be >= 1")
    if args.reward and ":" not in args.reward:
        parser.error("--reward takes PATH:NAME")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    config_class, trainer_class = require_trl()
    torch.set_num_threads(args.threads)
    path = args.model or default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    train = to_trl_dataset(load_prompt_rows(args.train_file))
    test_rows = load_prompt_rows(args.test_file)
    test_rows = test_rows[:args.eval_problems] if args.eval_problems else test_rows
    path_name = args.reward.rsplit(":", 1)
    config = RewardConfig(path=path_name[0], name=path_name[1]) if args.reward else None
    with RewardScorer(config) as scorer, tempfile.TemporaryDirectory() as output_dir:
        scorer.check_data_sources({*train["data_source"], *(r.data_source for r in test_rows)})
        reward = RelayReward(scorer, tokenizer)
        progress = Progress(tokenizer, path, test_rows, scorer, reward, TimedGenerate(model),
                            args.test_freq)
        trainer = trainer_class(model=model, reward_funcs=reward,
                                args=grpo_config(config_class, args, output_dir),
                                train_dataset=train, processing_class=tokenizer,
                                callbacks=[progress])
        trainer.remove_callback(PrinterCallback)  # it prints the final log to stdout
        trainer.train()
    seconds = progress.train_seconds
    accuracies = [a for _, _, a in progress.accuracies] or [float("nan")]
    emit("done", steps=args.steps, train_seconds=seconds,
         generated_tokens=reward.generated_tokens, completions=reward.completions,
         prompts=reward.prompts, tokens_per_s=reward.generated_tokens / seconds,
         accuracy_start=accuracies[0], accuracy_end=accuracies[-1],
         accuracy_peak=max(accuracies), eval_problems=len(test_rows) if args.test_freq else 0,
         threads=torch.get_num_threads(), model=path)


if __name__ == "__main__":
    main(sys.argv[1:])
