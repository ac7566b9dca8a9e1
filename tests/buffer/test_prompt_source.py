"""The prompt source cycles epochs and hands returned prompts out first."""

from buffer.prompt_source import PromptSource

from .conftest import make_dataset


def test_epochs_cycle_with_unique_ids() -> None:
    source = PromptSource(make_dataset(3), shuffle=True, seed=1)
    ids = [p.prompt_id for p in source.take(7)]
    assert len(set(ids)) == 7
    assert sorted(ids[:3]) == ["e0-0", "e0-1", "e0-2"]
    assert sorted(ids[3:6]) == ["e1-0", "e1-1", "e1-2"] and source.epoch == 2


def test_same_seed_same_order() -> None:
    a = [p.prompt_id for p in PromptSource(make_dataset(20), seed=5).take(20)]
    b = [p.prompt_id for p in PromptSource(make_dataset(20), seed=5).take(20)]
    c = [p.prompt_id for p in PromptSource(make_dataset(20), seed=6).take(20)]
    assert a == b and a != c


def test_returned_prompts_come_first() -> None:
    source = PromptSource(make_dataset(10), shuffle=False)
    first = source.take(2)
    source.give_back(first[1:])
    again = source.take(2)
    assert again[0].prompt_id == first[1].prompt_id and again[1].prompt_id == "e0-2"
    assert again[0].messages == [{"role": "user", "content": "What is 1 + 1?"}]
    assert again[0].ground_truth == "2"
