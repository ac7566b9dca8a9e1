"""Whose a checkpoint is: several runs may share a checkpoint dir, and none removes another's.

A checkpoint dir (``checkpoint.dir``) may hold several runs' checkpoints: a fresh run in a
reused folder, or a branch resumed from an earlier checkpoint of the same run. So each
checkpoint records its ``Lineage`` in ``meta.json`` (``relay.learner.checkpoint_meta``): a fresh
start makes a new one; a resume continues its checkpoint's, unless that lineage already has a
later intact checkpoint (then the run is a branch: a new lineage that names its parent).
Checkpoints written before lineages existed have none: they belong to no run, so they are
never removed (a run resumed from one starts a new lineage).

A ``step-<N>.tmp`` being written holds ``writer.json`` naming its lineage, host and process
(``claim``). After a save, ``prune`` removes only its own lineage's folders: checkpoints past
``keep_last`` (counted in its lineage), checkpoints of later steps (skipped on resume as
damaged: an intact one would have made the run a branch), and leftover ``.tmp`` /
``.replaced`` folders that are its lineage's, or that name no writer and are older than the
checkpoint just written. A run never writes over another lineage's ``step-<N>``: the
launcher refuses a run that would (``overwritten_checkpoints``), and ``claim`` refuses one
that appeared since.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable
from pathlib import Path

import msgspec
import torch.distributed as dist

from relay.learner.checkpoint_files import CheckpointError, write_durably
from relay.learner.checkpoint_meta import (
    COMPLETE_NAME,
    META_FILE,
    PARTIAL_SUFFIX,
    REPLACED_SUFFIX,
    Branch,
    Lineage,
    check_intact,
    read_meta,
    scan_complete,
)

logger = logging.getLogger(__name__)

WRITER_FILE = "writer.json"  # in a step-<N>.tmp while it is written (module docstring)


def new_lineage(parent: Branch | None = None) -> Lineage:
    """A lineage of a fresh start (``parent`` None) or of a branch from ``parent``."""
    return Lineage(id=secrets.token_hex(8), parent=parent)


class _Writer(msgspec.Struct, kw_only=True, frozen=True):
    """``writer.json``: who is writing a ``step-<N>.tmp``."""

    lineage: str
    host: str
    pid: int


class _MetaLineage(msgspec.Struct, frozen=True):
    """The lineage field of a ``meta.json`` (its other fields are not read)."""

    lineage: Lineage | None = None


def folder_lineage(folder: Path) -> str | None:
    """The lineage that wrote ``folder`` (a checkpoint or a leftover): its ``writer.json``'s,
    else its ``meta.json``'s ("" when that names none: written before lineages); None when
    neither reads (a folder that names no writer)."""
    try:
        return msgspec.json.decode((folder / WRITER_FILE).read_bytes(), type=_Writer).lineage
    except (OSError, msgspec.DecodeError):
        pass
    try:
        meta = msgspec.json.decode((folder / META_FILE).read_bytes(), type=_MetaLineage)
    except (OSError, msgspec.DecodeError):
        return None
    return meta.lineage.id if meta.lineage else ""


def _whose(owner: str | None) -> str:
    if owner is None:
        return "it names no writer: no readable meta.json"
    return f"lineage {owner}" if owner else "written before lineages"


def claim_name(final: Path, lineage: Lineage) -> None:
    """``CheckpointError`` unless ``final`` is free or holds ``lineage``'s checkpoint."""
    owner = folder_lineage(final) if final.exists() else lineage.id
    if owner != lineage.id:
        raise CheckpointError(f"{final}: holds another run's checkpoint ({_whose(owner)}); "
                              f"this run (lineage {lineage.id}) never writes over it. Give "
                              "this run a checkpoint.dir of its own, or move that folder away")


def claim(final: Path, lineage: Lineage) -> None:
    """Rank 0, before writing ``final``: refuse another lineage's checkpoint or leftover of
    this step; clear this lineage's leftovers of this step and those that name no writer
    (a crash while writing it); mark the new ``.tmp`` as this process's."""
    claim_name(final, lineage)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    for leftover in (partial, final.with_name(final.name + REPLACED_SUFFIX)):
        if not leftover.exists():
            continue
        owner = folder_lineage(leftover)
        if owner not in (None, lineage.id):
            raise CheckpointError(f"{leftover}: left, or being written, by another run "
                                  f"({_whose(owner)}); this run (lineage {lineage.id}) does not "
                                  "remove it. If that run is over, remove the folder; or give "
                                  "this run a checkpoint.dir of its own")
        shutil.rmtree(leftover)
    partial.mkdir()
    writer = _Writer(lineage=lineage.id, host=socket.gethostname(), pid=os.getpid())
    write_durably(partial / WRITER_FILE, msgspec.json.encode(writer))


def prune(folder: Path, kept: Path, lineage: Lineage, keep_last: int) -> None:
    """After writing ``kept``: remove ``lineage``'s checkpoints past its newest ``keep_last``
    up to ``kept`` and those of later steps, and the leftovers that are its own or that name
    no writer and are older than ``kept`` (module docstring). Never another lineage's."""
    step = int(COMPLETE_NAME.fullmatch(kept.name).group(1))
    complete, _incomplete = scan_complete(folder)
    own = sorted((meta.loop.step, path) for path, meta in complete
                 if meta.lineage is not None and meta.lineage.id == lineage.id)
    for later in [path for number, path in own if number > step]:
        logger.warning("removing %s: a later step of this run's own lineage, which it did not "
                       "resume from (a valid one would have made this run a branch)", later)
        shutil.rmtree(later)
    older = [path for number, path in own if number <= step]
    for old in older[:-keep_last]:
        shutil.rmtree(old)
    written = (kept / META_FILE).stat().st_mtime
    for leftover in sorted([*folder.glob(f"step-*{PARTIAL_SUFFIX}"),
                            *folder.glob(f"step-*{REPLACED_SUFFIX}")]):
        owner = folder_lineage(leftover)
        if owner == lineage.id or (owner is None and _last_modified(leftover) < written):
            logger.info("removing %s: left by an interrupted save", leftover)
            shutil.rmtree(leftover)


def _last_modified(folder: Path) -> float:
    return max(Path(root, name).lstat().st_mtime for root, dirs, files in os.walk(folder)
               for name in [".", *dirs, *files])


def continued_lineage(folder: Path, resume_from: Path | None) -> Lineage | None:
    """The lineage that a run resuming from ``resume_from`` (None: a fresh start) and saving
    into ``folder`` continues; None when it starts a new one: a fresh start, a checkpoint
    written before lineages, or a branch (its lineage has a later valid checkpoint in
    ``folder`` or beside ``resume_from``; damaged ones do not count)."""
    if resume_from is None:
        return None
    meta = read_meta(resume_from)
    if meta.lineage is None:
        return None
    later = sorted({path for where in {folder, resume_from.parent}
                    for path, other in scan_complete(where)[0]
                    if other.lineage == meta.lineage and other.loop.step > meta.loop.step})
    for path in later:
        try:
            check_intact(path, read_meta(path))
        except CheckpointError:
            continue  # damaged: the run goes on past it, and its save replaces it
        return None
    return meta.lineage


def run_lineage(folder: Path, resume_from: Path | None,
                group: dist.ProcessGroup | None = None) -> Lineage:
    """The lineage of the run's checkpoints (``continued_lineage``, or a new one naming the
    checkpoint it branched from), decided on rank 0 and logged; a collective (``group``: a
    CPU group of every rank, None for the default one)."""
    decided: list[Lineage | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        decided[0] = continued_lineage(folder, resume_from)
        if decided[0] is not None:
            logger.info("checkpoints continue lineage %s of %s", decided[0].id, resume_from)
        elif resume_from is None:
            decided[0] = new_lineage()
            logger.info("checkpoints start lineage %s", decided[0].id)
        else:
            meta = read_meta(resume_from)
            decided[0] = new_lineage(Branch(lineage=meta.lineage.id if meta.lineage else "",
                                            step=meta.loop.step, path=str(resume_from)))
            logger.info("checkpoints start lineage %s, a branch from %s (%s): the checkpoints "
                        "of other lineages in %s are kept", decided[0].id, resume_from,
                        _whose(meta.lineage.id if meta.lineage else ""), folder)
    if dist.is_initialized():
        dist.broadcast_object_list(decided, src=0, group=group)
    assert decided[0] is not None
    return decided[0]


def saves_at(step: int, save_freq: int, last: int) -> bool:
    """Whether the train loop writes a checkpoint after ``step`` (``trainer.save_freq``: every
    ``save_freq``-th step and the ``last``; never when it is not positive)."""
    return save_freq > 0 and (step % save_freq == 0 or step == last)


def overwritten_checkpoints(folder: Path, continued: Lineage | None,
                            steps: Iterable[int]) -> list[tuple[Path, str]]:
    """The folders of other lineages in ``folder`` that a run of lineage ``continued`` (None:
    a new one) saving after ``steps`` would have to write over (``save_checkpoint`` refuses
    to), each with whose it is: checkpoints and leftovers that name another writer. A
    leftover that names none is cleared by the save."""
    saved, own = set(steps), continued.id if continued else None
    clashes = []
    for path in sorted(folder.glob("step-*")) if folder.is_dir() else []:
        match = re.fullmatch(rf"step-(\d+)(?:{re.escape(PARTIAL_SUFFIX)}|"
                             rf"{re.escape(REPLACED_SUFFIX)})?", path.name)
        if match is None or int(match.group(1)) not in saved:
            continue
        owner = folder_lineage(path)
        if owner is None and path.name != f"step-{match.group(1)}":
            continue  # a leftover that names no writer: the save clears it
        if own is None or owner != own:
            clashes.append((path, _whose(owner)))
    return clashes
