"""The config a saved buffer state holds under: its fingerprint, and a resumed config's changes.

The buffer's part of a checkpoint (``BufferCheckpoint``) is a position in the prompt stream
and the lease gate's count of groups trained; each means something only under the config
that wrote it:

- ``data.train_files`` (the rows as loaded, after ``data.prompt_key`` and
  ``data.filter_overlong_prompts``: their count and SHA-256), ``data.seed``, ``data.shuffle``:
  the loader's position indexes this epoch's permutation of those rows and a prompt id names
  a row (``e<epoch>-<row>``), so other rows or another permutation repeat and skip rows and
  give other prompts the ids of prompts already trained on (or the loader cannot restore at
  all);
- ``data.train_batch_size``: the gate counts groups, the learner trains batches of this
  many, and a gate resumed at 100 steps x 32 groups under 16 per step stays shut;
- ``rollout.n``, ``model.path``: the samples per group and the policy (and its tokenizer):
  another experiment, not a continuation.

``buffer_fingerprint`` records them with the buffer's state; the launcher refuses a resumed
config that changes one, unless the user allows it by name (``trainer.resume_allow_changes``,
checked by ``relay.launcher.resolve``). Nothing else is recorded: learning rates, clip ratios,
``trainer.test_freq``, a longer run or another staleness bound may change on resume.
"""

from __future__ import annotations

import hashlib
from typing import get_args

import msgspec

from relay.configs.prompt_data import PromptDataset
from relay.configs.run_schema import FingerprintKey, RunConfig

Fingerprint = dict[str, str | int | bool]
STREAM_KEYS = ("data.train_files", "data.seed", "data.shuffle")
"""The keys that decide which row comes next and which prompt an id names."""
BATCH_KEY = "data.train_batch_size"
KEYS: tuple[str, ...] = get_args(FingerprintKey)  # STREAM_KEYS, BATCH_KEY, rollout.n, model.path
DIGEST_HEX = 16  # of SHA-256's 64 hex digits: enough to tell datasets apart


class Change(msgspec.Struct, frozen=True):
    """A fingerprint key whose value differs between a checkpoint and the config now."""

    key: str
    saved: str | int | bool | None  # None: the checkpoint did not record it
    now: str | int | bool | None

    def __str__(self) -> str:
        return f"{self.key}: {_shown(self.saved)} in the checkpoint, {_shown(self.now)} now"


def dataset_digest(dataset: PromptDataset) -> str:
    """``"<rows> rows, sha256 <hex>"``: the SHA-256 of the rows' msgpack encodings, in order."""
    digest = hashlib.sha256()
    encoder = msgspec.msgpack.Encoder()
    for row in dataset.rows:
        digest.update(encoder.encode(row))
    return f"{len(dataset)} rows, sha256 {digest.hexdigest()[:DIGEST_HEX]}"


def buffer_fingerprint(run: RunConfig, dataset: PromptDataset) -> Fingerprint:
    """The values of ``KEYS`` under ``run``, whose training rows are ``dataset``."""
    return {"data.train_files": dataset_digest(dataset), "data.seed": run.data.seed,
            "data.shuffle": run.data.shuffle, BATCH_KEY: run.data.train_batch_size,
            "rollout.n": run.rollout.n, "model.path": run.model.path}


def changes(saved: Fingerprint, now: Fingerprint) -> list[Change]:
    """Each key of ``KEYS`` whose value differs, in ``KEYS`` order. An empty ``saved`` (a
    checkpoint written before fingerprints) shows no change: there is nothing to compare."""
    if not saved:
        return []
    return [Change(key=key, saved=saved.get(key), now=now.get(key)) for key in KEYS
            if saved.get(key) != now.get(key)]


def _shown(value: str | int | bool | None) -> str:
    """As a TOML reader writes it (booleans lower-case), or "(not recorded)"."""
    if value is None:
        return "(not recorded)"
    return str(value).lower() if isinstance(value, bool) else str(value)
