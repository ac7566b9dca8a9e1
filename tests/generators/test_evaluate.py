"""Held-out evaluation (``generators.evaluate``): which responses ``trainer.log_val_generations``
logs, picked as verl picks them."""

from __future__ import annotations

import random

from generators.evaluate import sample_generations
from transport.messages import ValGeneration


def _generations(prompts: list[str], per_prompt: int = 1) -> list[ValGeneration]:
    return [ValGeneration(input=p, output=f"{p}-r{k}", score=float(k))
            for p in prompts for k in range(per_prompt)]


def test_the_logged_responses_are_verls_seeded_sample_not_the_first_rows() -> None:
    prompts = [f"p{i}" for i in range(10)]
    picked = sample_generations(_generations(prompts), 3)
    # numpy.random.RandomState(42).shuffle of 10 items puts items 8, 1, 5 first (verl's pick);
    # the first three rows, p0 p1 p2, are what a file-order pick would log
    assert [g.input for g in picked] == ["p8", "p1", "p5"]


def test_the_sample_depends_on_the_responses_not_on_their_order() -> None:
    generations = _generations([f"p{i}" for i in range(10)])
    shuffled = random.Random(7).sample(generations, len(generations))
    assert sample_generations(shuffled, 4) == sample_generations(generations, 4)


def test_a_prompts_responses_keep_their_order_before_the_shuffle() -> None:
    # 3 prompts x 2 responses, sorted by prompt: a-r0 a-r1 b-r0 b-r1 c-r0 c-r1; RandomState(42)
    # shuffles 6 items to positions 0, 1, 5, 2, 4, 3
    picked = sample_generations(_generations(["c", "a", "b"], per_prompt=2), 6)
    assert [g.output for g in picked] == ["a-r0", "a-r1", "c-r1", "b-r0", "c-r0", "b-r1"]


def test_nothing_is_kept_for_zero_and_everything_when_asking_for_more() -> None:
    generations = _generations(["x", "y"])
    assert sample_generations(generations, 0) == []
    assert sorted(g.input for g in sample_generations(generations, 5)) == ["x", "y"]
