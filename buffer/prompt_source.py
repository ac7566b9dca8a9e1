"""An endless, resumable stream of prompts from the run's dataset, with a return pool.

Rows come from torchdata's ``StatefulDataLoader`` (shuffled per epoch from a seed, so a
restored ``state_dict`` resumes mid-epoch); prompts that come back from expired or
returned leases are handed out again before new rows. Prompt ids are ``e<epoch>-<row>``:
unique per visit of a row. This module knows datasets; it knows nothing of leases.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from buffer.dataset import PromptDataset, PromptRow
from transport.messages import Prompt

# torchdata 0.11 calls a deprecated torch hook on every new iterator; the warning is noise.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


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
    """Prompts to lease: returned ones first, then the dataset, epoch after epoch."""

    def __init__(self, dataset: PromptDataset, *, shuffle: bool = True, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._loader = StatefulDataLoader(_Indexed(dataset), batch_size=1, shuffle=shuffle,
                                          generator=generator, collate_fn=_single)
        self._iterator: Iterator[tuple[int, PromptRow]] = iter(self._loader)
        self._returned: deque[Prompt] = deque()
        self.epoch = 0

    def take(self, count: int) -> list[Prompt]:
        prompts = [self._returned.popleft() for _ in range(min(count, len(self._returned)))]
        while len(prompts) < count:
            prompts.append(self._next_new())
        return prompts

    def give_back(self, prompts: list[Prompt]) -> None:
        self._returned.extend(prompts)

    @property
    def returned(self) -> int:
        return len(self._returned)

    def _next_new(self) -> Prompt:
        try:
            index, row = next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self._iterator = iter(self._loader)
            index, row = next(self._iterator)
        return to_prompt(f"e{self.epoch}-{index}", row)
