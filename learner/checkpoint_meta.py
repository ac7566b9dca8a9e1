"""What a checkpoint folder says about itself, and finding the ones that can be resumed.

A checkpoint ``step-<N>`` (``relay.learner.checkpoint``) is complete when its ``meta.json``
(``CheckpointMeta``, written last) reads and names step N in this ``FORMAT``; any other
``step-*`` folder (a ``.tmp`` left by a crash, a folder without ``meta.json``, one of an
older format) is skipped with a warning naming it. ``meta.json`` also records the lineage of
the run that wrote it (``relay.learner.checkpoint_lineage``), when it was written, and the size and
SHA-256 of every other file (``relay.learner.checkpoint_files``).

A complete checkpoint is intact (``check_intact``) when it is this user's and neither the
group nor others can write it, every file matches the manifest, and its DCP metadata reads
without running code (``relay.learner.safe_dcp``); a checkpoint written before the manifest is
taken unverified, with a warning.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import msgspec

from relay.learner import safe_dcp
from relay.learner.checkpoint_files import (
    REPLACED_SUFFIX,
    CheckpointError,
    FileDigest,
    check_owner_and_mode,
    verify_manifest,
)

logger = logging.getLogger(__name__)

FORMAT = 1  # CheckpointMeta.format; a checkpoint of another format is not resumed
META_FILE = "meta.json"
PARTIAL_SUFFIX = ".tmp"
COMPLETE_NAME = re.compile(r"step-(\d+)")
DCP_METADATA = "dcp/.metadata"


class LoopState(msgspec.Struct, kw_only=True, frozen=True):
    """Where the train loop stands after ``step``: the newest published weight ``version``
    and whether the policy has changed since it was published."""

    step: int
    version: int
    unpublished_update: bool = False


class Branch(msgspec.Struct, kw_only=True, frozen=True):
    """Where a lineage started from: checkpoint ``path`` at ``step`` of lineage ``lineage``
    ("": one written before lineages)."""

    lineage: str
    step: int
    path: str


class Lineage(msgspec.Struct, kw_only=True, frozen=True):
    """The run a checkpoint belongs to (``relay.learner.checkpoint_lineage``): ``id`` is made by a
    fresh start or a branch and carried on by every resume that continues it; ``parent``:
    the checkpoint a branch started from (None for a fresh start)."""

    id: str
    parent: Branch | None = None


class CheckpointMeta(msgspec.Struct, kw_only=True, frozen=True):
    """``meta.json``, the completion marker (module docstring). ``schedulers`` holds each
    trained part's ``LRScheduler.state_dict()``; ``kl_coef`` the KL controller's
    coefficient (None without KL in the reward)."""

    format: int
    loop: LoopState
    steps_done: int
    world_size: int
    parts: list[str]
    schedulers: dict[str, dict[str, Any]]
    kl_coef: float | None = None
    mlflow_run_id: str = ""
    lineage: Lineage | None = None  # None: written before lineages
    saved_at: float = 0.0  # Unix time of the save; 0: written before it was recorded
    files: dict[str, FileDigest] = {}  # the manifest; empty: written before it existed


def read_meta(checkpoint: Path) -> CheckpointMeta:
    """The checkpoint's ``meta.json``; ``CheckpointError`` when it is not a complete
    checkpoint of this format."""
    match = COMPLETE_NAME.fullmatch(checkpoint.name)
    if checkpoint.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(f"{checkpoint}: incomplete, its writing did not finish")
    if match is None:
        raise CheckpointError(f"{checkpoint}: not a checkpoint folder (step-<N>)")
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: no such checkpoint folder")
    path = checkpoint / META_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint}: incomplete, no {META_FILE}") from None
    try:
        fields = msgspec.json.decode(raw, type=dict[str, Any])
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from exc
    if fields.get("format") != FORMAT:
        raise CheckpointError(f"{path}: written by another version of Relay (format "
                              f"{fields.get('format')}, this one reads {FORMAT}); it cannot "
                              "be resumed")
    try:
        meta = msgspec.convert(fields, type=CheckpointMeta)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from exc
    if meta.loop.step != int(match.group(1)):
        raise CheckpointError(f"{path}: says step {meta.loop.step}, the folder says "
                              f"{match.group(1)}")
    return meta


def scan_complete(folder: Path) -> tuple[list[tuple[Path, CheckpointMeta]], list[tuple[Path, str]]]:
    """The complete checkpoints in ``folder`` with their meta, by step, and the other
    ``step-*`` folders with why each is not complete."""
    complete: list[tuple[Path, CheckpointMeta]] = []
    incomplete: list[tuple[Path, str]] = []
    for path in sorted(folder.glob("step-*")) if folder.is_dir() else []:
        try:
            complete.append((path, read_meta(path)))
        except CheckpointError as exc:
            incomplete.append((path, str(exc)))
    return sorted(complete, key=lambda item: item[1].loop.step), incomplete


def scan_checkpoints(folder: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """The complete checkpoints in ``folder`` by step, oldest first, and the other
    ``step-*`` folders with why each is not complete."""
    complete, incomplete = scan_complete(folder)
    return [(meta.loop.step, path) for path, meta in complete], incomplete


def newest_first(folder: Path) -> list[tuple[Path, CheckpointMeta]]:
    """The complete checkpoints in ``folder``, the most recently written first (``saved_at``;
    by step among those written before it was recorded, which count as older); every other
    ``step-*`` folder is skipped with a warning that names it."""
    complete, incomplete = scan_complete(folder)
    for _path, why in incomplete:
        logger.warning("skipping %s", why)
    return sorted(complete, key=lambda item: (item[1].saved_at, item[1].loop.step),
                  reverse=True)


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (``newest_first``; None if none)."""
    complete = newest_first(folder)
    return complete[0][0] if complete else None


def verify_files(checkpoint: Path, meta: CheckpointMeta) -> None:
    """``CheckpointError`` naming the first file of ``checkpoint`` whose size or SHA-256
    differs from its manifest; a warning when it has none (written before manifests)."""
    if not meta.files:
        logger.warning("%s: written before checkpoints recorded checksums: its files are not "
                       "verified", checkpoint)
        return
    verify_manifest(checkpoint, meta.files)


def check_intact(checkpoint: Path, meta: CheckpointMeta) -> None:
    """``CheckpointError`` naming the folder or file unless ``checkpoint`` is this user's and
    not writable by the group or others, every file is as its manifest recorded
    (``verify_files``) and its DCP metadata holds only DCP's metadata types."""
    check_owner_and_mode(checkpoint)
    verify_files(checkpoint, meta)
    path = checkpoint / DCP_METADATA
    try:
        with open(path, "rb") as stream:
            safe_dcp.read_metadata(stream, str(path))
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from exc
