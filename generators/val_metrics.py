"""verl's validation metrics of one held-out evaluation: ``mean@N``, ``std@N``, ``best@N``,
``worst@N`` and ``maj@N`` per data source and variable, with bootstrap standard deviations.

For every prompt, its N scored responses give, for each numeric variable (``reward``, the
score, and each numeric entry of the reward's ``info``, e.g. ``acc``):

    mean@N        mean of the N values
    std@N         their population standard deviation (N > 1)
    best@k/mean   mean over B bootstrap draws of max(k values drawn with replacement)
    best@k/std    standard deviation of those B maxima; worst@k: the same with min
    maj@k/mean    the same with the value of the majority answer (``pred``; ties go to the
    maj@k/std     answer seen first, and its first response's value), when responses have one

for k = 2, 4, 8, ... below N, and N (N > 1). Each is averaged over the prompts of a data
source. Names follow verl: ``val-core/<data_source>/<var>/<metric>`` for the core variable
(``acc`` where the reward reports it, else ``reward``) and the ``mean``, ``maj`` and ``best``
metrics at the largest N; ``val-aux/...`` for the rest (a character a tracker refuses in a
name, such as ``+``, becomes ``_``). The bootstrap draws B = 1000 times
from a generator seeded with ``seed`` afresh for every (prompt, variable, k), so the numbers
do not depend on the order of the data. This module knows numbers; it knows nothing of
engines or rewards.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

BOOTSTRAP_DRAWS = 1000
SEED = 42  # verl's
UNNAMEABLE = re.compile(r"[^\w./\- :]")  # what a tracker's metric name may not hold


class ScoredResponse(msgspec.Struct, frozen=True):
    """One held-out response: its prompt (``prompt``: an id unique in the evaluation), its
    variables (``reward`` and the reward's numeric ``info``) and its extracted answer."""

    data_source: str
    prompt: int
    values: dict[str, float]
    pred: str = ""


Reducer = Callable[[np.ndarray], np.ndarray]  # picks (draws, k) -> a value per draw (draws,)


def bootstrap(size: int, count: int, reducers: Sequence[Reducer], rng: np.random.Generator,
              draws: int = BOOTSTRAP_DRAWS) -> list[tuple[float, float]]:
    """(mean, std) over ``draws`` subsets of ``count`` of ``size`` items drawn with
    replacement, of each reducer's value on a subset. The subsets are drawn at once, as a
    (draws, count) matrix of item indices, and every reducer maps it to a value per draw."""
    picks = rng.integers(0, size, size=(draws, count))
    return [(float(np.mean(reduced)), float(np.std(reduced)))
            for reduced in (reduce(picks) for reduce in reducers)]


def majority_values(answers: Sequence[str], values: np.ndarray,
                    picks: np.ndarray) -> np.ndarray:
    """For each subset (a row of item indices ``picks``, (draws, k)): the value of the first
    pick whose answer is the subset's most common one (ties go to the answer seen first)."""
    codes = np.unique(np.asarray(answers), return_inverse=True)[1].reshape(-1)[picks]
    k, rows = picks.shape[1], np.arange(len(picks))
    same = codes[:, :, None] == codes[:, None, :]  # pick j holds pick i's answer
    counts, first = same.sum(2), same.argmax(2)  # per pick i: its answer's count and first pick
    winner = first[rows, (counts * (k + 1) - first).argmax(1)]  # most common, then earliest
    return values[picks[rows, winner]]


def subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below ``n``, then ``n``."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def prompt_metrics(values: Sequence[float], preds: Sequence[str] | None,
                   seed: int = SEED, draws: int = BOOTSTRAP_DRAWS) -> dict[str, float]:
    """The metrics of one prompt's N values of one variable (module docstring); ``preds``:
    the responses' answers, for ``maj@k`` (None: no answers)."""
    n = len(values)
    metrics = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return metrics
    metrics[f"std@{n}"] = float(np.std(values))
    array = np.asarray(values, dtype=np.float64)
    for k in subset_sizes(n):
        (best, best_std), (worst, worst_std) = bootstrap(
            n, k, [lambda picks: array[picks].max(1), lambda picks: array[picks].min(1)],
            np.random.default_rng(seed), draws)
        metrics.update({f"best@{k}/mean": best, f"best@{k}/std": best_std,
                        f"worst@{k}/mean": worst, f"worst@{k}/std": worst_std})
        if preds is not None:
            [(maj, maj_std)] = bootstrap(
                n, k, [lambda picks: majority_values(preds, array, picks)],
                np.random.default_rng(seed), draws)
            metrics.update({f"maj@{k}/mean": maj, f"maj@{k}/std": maj_std})
    return metrics


def validation_metrics(responses: Sequence[ScoredResponse], seed: int = SEED,
                       draws: int = BOOTSTRAP_DRAWS) -> dict[str, float]:
    """verl's ``val-core/...`` and ``val-aux/...`` metrics of an evaluation's responses."""
    grouped: dict[str, dict[int, list[ScoredResponse]]] = defaultdict(lambda: defaultdict(list))
    for response in responses:
        grouped[response.data_source][response.prompt].append(response)
    per_prompt: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    n_max = 0
    for source, prompts in grouped.items():
        for group in prompts.values():
            n_max = max(n_max, len(group))
            preds = [r.pred for r in group] if all(r.pred for r in group) else None
            for var in group[0].values:
                values = [r.values.get(var, 0.0) for r in group]
                for name, value in prompt_metrics(values, preds, seed, draws).items():
                    per_prompt[(source, var, name)].append(value)
    core_var = "acc" if any("acc" in r.values for r in responses) else "reward"
    metrics = {}
    for (source, var, name), values in sorted(per_prompt.items()):
        core = (var == core_var and name.startswith(("mean", "maj", "best"))
                and name.split("/")[0].endswith(f"@{n_max}"))
        prefix = "val-core" if core else "val-aux"
        metrics[f"{prefix}/{UNNAMEABLE.sub('_', source)}/{UNNAMEABLE.sub('_', var)}/{name}"] = \
            float(np.mean(values))
    return metrics
