"""The prompt source cycles epochs, hands returned prompts out first and deferred ones at
the epoch's end, and resumes: a restored source hands out what was not settled, then
continues the stream exactly."""

from pathlib import Path

import pytest

from relay.buffer.prompt_source import (
    BUFFER_CHECKPOINT_FILE,
    BufferCheckpointError,
    PromptSource,
    read_buffer_checkpoint,
    write_buffer_checkpoint,
)
from relay.transport.messages import BufferCheckpoint

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


def ids(prompts) -> list[str]:
    return [p.prompt_id for p in prompts]


def test_deferred_prompts_come_after_the_rest_of_the_epoch_and_once_only() -> None:
    """A prompt whose group the replay evicted unused used to come back first, to be
    generated and passed over again at once; deferred, it waits for the epoch's end."""
    source = PromptSource(make_dataset(4), shuffle=False)
    first = source.take(2)  # e0-0, e0-1
    source.defer([first[0]])
    assert source.deferred == 1 and source.returned == 0
    assert ids(source.take(5)) == ["e0-2", "e0-3", "e0-0", "e1-0", "e1-1"]
    assert source.deferred == 0 and source.epoch == 1
    assert "e0-0" in ids(source.state().pending)  # pending until settled
    source.defer([first[0]])  # evicted again: done with (e1-0 is its row's new visit)
    assert source.deferred == 0 and "e0-0" not in ids(source.state().pending)
    assert ids(source.take(3)) == ["e1-2", "e1-3", "e2-0"]


def test_a_restored_source_hands_out_deferred_prompts_first() -> None:
    """The state does not tell deferred prompts from returned ones (module docstring)."""
    source = PromptSource(make_dataset(4), shuffle=False)
    first = source.take(2)
    source.settle([first[1].prompt_id])
    source.defer([first[0]])
    restored = PromptSource(make_dataset(4), shuffle=False)
    restored.restore(source.state())
    assert ids(restored.take(3)) == ["e0-0", "e0-2", "e0-3"]


@pytest.mark.parametrize("taken", [0, 3, 5, 7, 10, 12])
def test_a_restored_source_continues_the_stream_exactly(taken: int) -> None:
    """Mid-epoch, at an epoch's end and past it: the same prompts, ids and shuffles as a
    source that was never interrupted."""
    source = PromptSource(make_dataset(5), shuffle=True, seed=4)
    source.settle(ids(source.take(taken)))
    state = source.state()
    restored = PromptSource(make_dataset(5), shuffle=True, seed=4)
    restored.restore(state)
    assert ids(restored.take(13)) == ids(source.take(13))
    assert restored.epoch == source.epoch


def test_later_epochs_shuffle_by_seed_and_epoch() -> None:
    epochs = [ids(PromptSource(make_dataset(8), seed=2).take(24))[8 * e:8 * e + 8]
              for e in range(3)]
    orders = [[i.split("-")[1] for i in epoch] for epoch in epochs]
    assert len({tuple(o) for o in orders}) == 3  # a new permutation each epoch


def test_unsettled_prompts_come_back_first_after_a_restore_in_the_order_first_taken() -> None:
    source = PromptSource(make_dataset(10), shuffle=False)
    first = source.take(4)  # e0-0 .. e0-3
    source.give_back([first[2]])
    source.settle([first[0].prompt_id, first[3].prompt_id])  # trained, or dropped for good
    assert ids(source.state().pending) == ["e0-1", "e0-2"] and source.returned == 1
    restored = PromptSource(make_dataset(10), shuffle=False)
    restored.restore(source.state())
    again = restored.take(4)
    assert ids(again) == ["e0-1", "e0-2", "e0-4", "e0-5"]
    assert again[0] == first[1]  # the whole prompt, messages and answer included
    assert ids(restored.state().pending) == ["e0-1", "e0-2", "e0-4", "e0-5"]


def test_the_buffer_checkpoint_file_round_trips(tmp_path: Path) -> None:
    source = PromptSource(make_dataset(6), seed=1)
    source.take(3)
    saved = BufferCheckpoint(step=7, source=source.state(), accepted=12)
    write_buffer_checkpoint(tmp_path, saved)
    loaded = read_buffer_checkpoint(tmp_path)
    assert (loaded.step, loaded.accepted, loaded.source.epoch) == (7, 12, 0)
    assert loaded.source.pending == saved.source.pending
    restored = PromptSource(make_dataset(6), seed=1)
    restored.restore(loaded.source)
    assert ids(restored.take(9)) == ids(source.state().pending) + ids(source.take(6))


def test_a_missing_or_torn_buffer_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(BufferCheckpointError, match="buffer.rec: missing"):
        read_buffer_checkpoint(tmp_path)
    source = PromptSource(make_dataset(2))
    write_buffer_checkpoint(tmp_path, BufferCheckpoint(step=1, source=source.state()))
    path = tmp_path / BUFFER_CHECKPOINT_FILE
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(BufferCheckpointError, match="buffer.rec: unreadable"):
        read_buffer_checkpoint(tmp_path)
