"""An endless, resumable stream of prompts from the run's dataset, with a return pool.

Rows come from torchdata's ``StatefulDataLoader``, shuffled per epoch by a generator seeded
from ``data.seed`` and the epoch (epoch 0 by the seed itself), so a restored
``state_dict`` resumes mid-epoch and every later epoch is the same permutation as in an
uninterrupted run. Prompts that come back from expired or returned leases are handed out
again before new rows; deferred prompts (a group the replay evicted unused: generated again
at once, it would most likely be passed over again) after the rest of the epoch's rows,
once: deferred again, a prompt is done with (its row comes again in the next epoch), so no
prompt circulates from epoch to epoch beside its row's new visits.
Prompt ids are ``e<epoch>-<row>``: unique per visit of a row. This module knows datasets;
it knows nothing of leases.

Resuming. A prompt handed out stays *pending* until its caller settles it (trained on, or
dropped for good); a prompt given back stays pending. ``state`` is the loader's position
plus every pending prompt in the order first handed out; ``restore`` puts those prompts in
the return pool, so a restored source hands them out again, in that order, before new rows.
Deferred prompts are pending too, and the state does not tell them apart: a restored
source hands them out first. The buffer's whole checkpoint (``BufferCheckpoint``: this state
and the hub's count of groups trained) is one ``relay.transport.records`` record in the learner's
checkpoint folder, ``BUFFER_CHECKPOINT_FILE``, written by the learner
(``write_buffer_checkpoint``) and read by a restarted buffer (``read_buffer_checkpoint``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from relay.configs.prompt_data import PromptDataset, PromptRow
from relay.transport.codec import Decoder, WireError, encode
from relay.transport.messages import BufferCheckpoint, Prompt, PromptSourceState
from relay.transport.records import RecordError, pack, unpack

# torchdata 0.11 calls a deprecated torch hook on every new iterator; the warning is noise.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

BUFFER_CHECKPOINT_FILE = "buffer.rec"  # in a learner checkpoint folder
EPOCH_SEED_STRIDE = 1_000_003  # epoch e shuffles with seed + e * stride


class _Indexed(Dataset):
    """Yields (row index, row) so that prompt ids can name the row."""

    def __init__(self, rows: PromptDataset) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[int, PromptRow]:
        return index, self.rows[index]


def _single(batch: list[tuple[int, PromptRow]]) -> tuple[int, PromptRow]:
    return batch[0]


def to_prompt(prompt_id: str, row: PromptRow) -> Prompt:
    return Prompt(prompt_id=prompt_id,
                  messages=[{"role": m.role, "content": m.content} for m in row.prompt],
                  data_source=row.data_source, ground_truth=row.reward_model.ground_truth,
                  extra_info=dict(row.extra_info))


class PromptSource:
    """Prompts to lease: returned ones first, then the dataset, epoch after epoch, with the
    prompts deferred during an epoch at its end."""

    def __init__(self, dataset: PromptDataset, *, shuffle: bool = True, seed: int = 0) -> None:
        self._rows, self._shuffle, self._seed = dataset, shuffle, seed
        self._generator = torch.Generator().manual_seed(seed)
        self._loader = StatefulDataLoader(_Indexed(dataset), batch_size=1, shuffle=shuffle,
                                          generator=self._generator, collate_fn=_single)
        self._iterator: Iterator[tuple[int, PromptRow]] = iter(self._loader)
        self._returned: deque[Prompt] = deque()
        self._deferred: deque[Prompt] = deque()
        self._deferred_ids: set[str] = set()  # pending prompts deferred once already
        self._pending: OrderedDict[str, Prompt] = OrderedDict()
        self.epoch = 0

    def take(self, count: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        while len(prompts) < count:
            prompt = self._returned.popleft() if self._returned else self._next_new()
            self._pending.setdefault(prompt.prompt_id, prompt)
            prompts.append(prompt)
        return prompts

    def give_back(self, prompts: list[Prompt]) -> None:
        """Prompts to hand out again first; they stay pending."""
        for prompt in prompts:
            self._pending.setdefault(prompt.prompt_id, prompt)
        self._returned.extend(prompts)

    def defer(self, prompts: list[Prompt]) -> None:
        """Prompts to hand out again after the rest of this epoch's rows, before the next
        epoch's; they stay pending. A prompt deferred before is settled instead."""
        for prompt in prompts:
            if prompt.prompt_id in self._deferred_ids:
                self.settle([prompt.prompt_id])
                continue
            self._deferred_ids.add(prompt.prompt_id)
            self._pending.setdefault(prompt.prompt_id, prompt)
            self._deferred.append(prompt)

    def settle(self, prompt_ids: Iterable[str]) -> None:
        """These prompts are done with (trained on, or dropped for good): a restored source
        does not hand them out again. Unknown ids are ignored (settled already)."""
        for prompt_id in prompt_ids:
            self._pending.pop(prompt_id, None)
            self._deferred_ids.discard(prompt_id)

    @property
    def returned(self) -> int:
        """Prompts in the return pool."""
        return len(self._returned)

    @property
    def deferred(self) -> int:
        """Prompts deferred to the end of this epoch."""
        return len(self._deferred)

    def state(self) -> PromptSourceState:
        """The loader's position and the pending prompts (module docstring)."""
        return PromptSourceState(epoch=self.epoch, loader=self._loader.state_dict(),
                                 pending=list(self._pending.values()))

    def restore(self, state: PromptSourceState, *, same_rows: bool = True) -> None:
        """Continue from ``state``: its pending prompts first, then the loader's rows from
        where it stood, on a source built from the same dataset, shuffle and seed; a
        position these rows do not have is a ``PromptStreamError``. ``same_rows=False``
        (the rows, their seed or their shuffle changed since: ``relay.buffer.fingerprint``): the
        rows start afresh at the next epoch instead, so that no prompt id names two
        prompts."""
        self.epoch = state.epoch if same_rows else state.epoch + 1
        self._generator.manual_seed(self._epoch_seed())
        try:
            if same_rows:
                self._loader.load_state_dict(state.loader)
            self._iterator = iter(self._loader)
        except Exception as exc:  # torchdata restoring a position these rows do not have
            raise PromptStreamError(
                f"the saved prompt stream stood {state.loader.get('_num_yielded', '?')} rows "
                f"into epoch {state.epoch}, which does not fit these {len(self._rows)} "
                f"training rows with data.shuffle = {str(self._shuffle).lower()} "
                f"({type(exc).__name__}: {exc}): data.train_files (or data.prompt_key, "
                "data.filter_overlong_prompts), data.shuffle or data.seed changed since the "
                "checkpoint was written. Resume with the checkpoint's values, or start afresh "
                "(trainer.resume_mode=disable)") from exc
        self._returned = deque(state.pending)
        self._deferred, self._deferred_ids = deque(), set()
        self._pending = OrderedDict((p.prompt_id, p) for p in state.pending)

    def _epoch_seed(self) -> int:
        return (self._seed + self.epoch * EPOCH_SEED_STRIDE) % (1 << 63)

    def _next_new(self) -> Prompt:
        """The epoch's next row; at its end, the next epoch begins after the prompts
        deferred during this one (they join the return pool, which is empty here)."""
        try:
            index, row = next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self._generator.manual_seed(self._epoch_seed())
            self._iterator = iter(self._loader)
            if self._deferred:
                self._returned.extend(self._deferred)
                self._deferred.clear()
                return self._returned.popleft()
            index, row = next(self._iterator)
        return to_prompt(f"e{self.epoch}-{index}", row)


class PromptStreamError(ValueError):
    """A saved prompt stream does not fit the rows it is restored over (the message says
    which keys may have changed)."""


class BufferCheckpointError(ValueError):
    """A checkpoint's buffer record is missing or unreadable (the message names the file)."""


def write_buffer_checkpoint(folder: Path, checkpoint: BufferCheckpoint) -> Path:
    """Write ``checkpoint`` into ``folder`` as one record; the caller makes it durable."""
    path = folder / BUFFER_CHECKPOINT_FILE
    path.write_bytes(pack(encode(checkpoint)))
    return path


def read_buffer_checkpoint(folder: Path) -> BufferCheckpoint:
    """The buffer's state saved in checkpoint ``folder``."""
    path = folder / BUFFER_CHECKPOINT_FILE
    try:
        frames = unpack(path.read_bytes())
        message = Decoder(BufferCheckpoint).decode([bytearray(f) for f in frames])
    except FileNotFoundError:
        raise BufferCheckpointError(f"{path}: missing; the checkpoint holds no buffer state "
                                    "to resume the prompt stream from") from None
    except (RecordError, WireError) as exc:
        raise BufferCheckpointError(f"{path}: unreadable buffer state: {exc}") from exc
    assert isinstance(message, BufferCheckpoint)
    return message
