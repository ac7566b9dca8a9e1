"""Held-out evaluation's work: decode the validation prompts with an engine and score them.

The prompts are decoded with ``rollout.val_kwargs`` (greedy by default) and scored with the
task's reward function. This module is functions only; the process that runs them on the
weights the learner hands out for evaluation is ``relay.generators.evaluator``.

    accuracy = mean over samples of info["acc"] when the reward function reports one
               (verl's math rewards do), else of [score >= 1]

The responses kept as text for ``trainer.log_val_generations`` are verl's sample of them
(``sample_generations``): the same positions at every evaluation, so a table follows the
same prompts through training. With ``record`` every response is kept as verl's
``trainer.validation_data_dir`` dump holds it (``write_generations``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from relay.algorithms.rewards.result import RewardItem, RewardResult
from relay.algorithms.rewards.scorer import RewardScorer
from relay.configs.prompt_data import CutSide, PromptRow, truncate_prompt
from relay.generators.engine import Completion, Engine, GroupRequest
from relay.generators.sampling import SamplingParams
from relay.generators.tool_loop import ConfiguredWorkflow
from relay.generators.val_metrics import ScoredResponse, validation_metrics
from relay.generators.workflow import EpisodeCompletion, EpisodeRow, WorkflowRunner, play_episodes
from relay.transport.messages import ValGeneration

EVAL_BATCH = 256
GENERATIONS_SEED = 42  # verl's, for the sample of logged held-out responses


class EvalResult(msgspec.Struct, frozen=True):
    accuracy: float
    reward_mean: float
    response_length_mean: float
    samples: int
    by_source: dict[str, float]  # accuracy per data_source
    # verl's val-core/... and val-aux/... (relay.generators.val_metrics)
    verl: dict[str, float] = {}
    generations: list[ValGeneration] = []  # sample_generations' pick of the responses
    records: list[dict[str, Any]] = []  # with record: every response (write_generations)


def eval_metrics(result: EvalResult) -> dict[str, float]:
    """The ``eval/...`` metrics of one evaluation (per data source when there are several)."""
    metrics = {"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean,
               "eval/response_length_mean": result.response_length_mean}
    if len(result.by_source) > 1:
        metrics.update({f"eval/accuracy/{s}": a for s, a in result.by_source.items()})
    metrics.update(result.verl)
    return metrics


def sample_generations(generations: Sequence[ValGeneration],
                       count: int) -> list[ValGeneration]:
    """verl's sample of held-out responses to log (``trainer.log_val_generations``): every
    response, sorted by its prompt's text (a stable sort: a prompt's responses keep their
    order), shuffled by ``numpy.random.RandomState(GENERATIONS_SEED)``, the first ``count``.
    The permutation depends only on how many there are, so every evaluation of the same
    data logs the same positions (``RayPPOTrainer._maybe_log_val_generations``)."""
    if count <= 0:
        return []
    ordered = sorted(generations, key=lambda g: g.input)
    np.random.RandomState(GENERATIONS_SEED).shuffle(ordered)
    return ordered[:count]


def write_generations(directory: Path, step: int, records: Sequence[dict[str, Any]]) -> Path:
    """Every held-out response of the evaluation of ``step`` as ``<directory>/<step>.jsonl``,
    one JSON object a line, as verl's ``trainer.validation_data_dir`` dump writes them: the
    prompt as the model saw it (``input``), the response (``output``), the ground truth
    (``gts``), the reward (``score``), ``step``, and the reward function's extra values. The
    file is written beside its name and renamed into place: a reader never sees half of it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps({**record, "step": step}, ensure_ascii=False) + "\n"
                               for record in records), encoding="utf-8")
    partial.replace(path)
    return path


def is_correct(result: RewardResult) -> float:
    if "acc" in result.info:
        return float(result.info["acc"] > 0)
    return float(result.score >= 1.0)


def evaluate(engine: Engine, tokenizer, rows: list[PromptRow], scorer: RewardScorer,
             params: SamplingParams, n: int = 1, max_prompt_length: int = 1 << 30,
             truncation: CutSide = "left", keep: int = 0, record: bool = False,
             workflow: ConfiguredWorkflow | None = None,
             runner: WorkflowRunner | None = None) -> EvalResult:
    """Generate ``n`` responses per row and score them; a prompt longer than
    ``max_prompt_length`` tokens is cut on its ``truncation`` side (``truncate_prompt``).
    ``keep`` responses, verl's sample of all of them (``sample_generations``), are kept as
    text (``trainer.log_val_generations``); with ``record``, every response with its ground
    truth and the reward's extra values (``EvalResult.records``, ``write_generations``).
    With a ``workflow`` (and its ``runner``) each response is an episode it plays (the
    multi-turn tool loop), scored by its own reward or else the reward function, and the
    metrics add ``eval/turns_mean`` and ``eval/tool_calls_mean``."""
    if (workflow is None) != (runner is None):
        raise ValueError("evaluate: a workflow needs its runner, and a runner its workflow")
    correct = rewards = lengths = 0.0
    turns = tool_calls = 0.0
    per_source: dict[str, list[float]] = defaultdict(list)
    scored: list[ScoredResponse] = []
    generations: list[ValGeneration] = []
    records: list[dict[str, Any]] = []
    for start in range(0, len(rows), EVAL_BATCH):
        chunk = rows[start:start + EVAL_BATCH]
        prompts = []
        for row in chunk:
            messages = [{"role": m.role, "content": m.content} for m in row.prompt]
            render = workflow.render_prompt if workflow is not None else None
            ids = render(tokenizer, messages) if render is not None else \
                tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
            prompts.extend([truncate_prompt(ids, max_prompt_length, truncation)] * n)
        if runner is None:
            completions = engine.generate(prompts, params)
        else:
            completions = [c for group in play_episodes(runner, engine, [
                (GroupRequest(i, prompts[i * n], n, params),
                 _episode_row(f"val/{start + i}", row, prompts[i * n]))
                for i, row in enumerate(chunk)]) for c in group]
        items, texts = [], []
        for index, completion in enumerate(completions):
            row = chunk[index // n]
            text = tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True)
            items.append(RewardItem(row.data_source, text, row.reward_model.ground_truth,
                                    dict(row.extra_info)))
            texts.append(text)
            lengths += completion.token_ids.numel()
        for completion in completions:
            if isinstance(completion, EpisodeCompletion):
                turns += completion.stats.turns
                tool_calls += completion.stats.tool_calls
        for index, (item, result) in enumerate(zip(items, _scores(scorer, items, completions),
                                                   strict=True)):
            scored.append(ScoredResponse(data_source=item.data_source, prompt=start + index // n,
                                         values={"reward": result.score, **result.info},
                                         pred=result.pred))
            if keep or record:
                if index % n == 0:  # a row's n responses share its prompt
                    prompt_text = tokenizer.decode(prompts[index], skip_special_tokens=True)
                generations.append(ValGeneration(input=prompt_text, output=texts[index],
                                                 score=result.score))
            if record:
                pred = {"pred": result.pred} if result.pred else {}
                records.append({"input": prompt_text, "output": texts[index],
                                "gts": item.ground_truth, "score": result.score,
                                **result.info, **pred})
            hit = is_correct(result)
            correct += hit
            rewards += result.score
            per_source[item.data_source].append(hit)
    total = max(len(rows) * n, 1)
    episodes = {} if runner is None else {"eval/turns_mean": turns / total,
                                          "eval/tool_calls_mean": tool_calls / total}
    return EvalResult(accuracy=correct / total, reward_mean=rewards / total,
                      response_length_mean=lengths / total, samples=len(rows) * n,
                      by_source={s: sum(v) / len(v) for s, v in per_source.items()},
                      verl={**validation_metrics(scored), **episodes},
                      generations=sample_generations(generations, keep), records=records)


def _scores(scorer: RewardScorer, items: list[RewardItem],
            completions: Sequence[Completion]) -> list[RewardResult]:
    """An episode's own reward where its workflow gave one, else the reward function's."""
    own = [c.reward if isinstance(c, EpisodeCompletion) else None for c in completions]
    scored = iter(scorer.score([item for item, r in zip(items, own, strict=True) if r is None]))
    return [next(scored) if r is None else RewardResult(score=r) for r in own]


def _episode_row(prompt_id: str, row: PromptRow, prompt_ids: list[int]) -> EpisodeRow:
    return EpisodeRow(prompt_id=prompt_id,
                      messages=[{"role": m.role, "content": m.content} for m in row.prompt],
                      data_source=row.data_source, ground_truth=row.reward_model.ground_truth,
                      extra_info=dict(row.extra_info), prompt_ids=prompt_ids, sample_index=0)
