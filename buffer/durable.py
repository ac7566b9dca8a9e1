"""Making what a process wrote survive a crash: ``fsync`` of a folder's entries and of a
whole tree of files.

A file's bytes are durable once the file is fsynced; its name (a new file, a rename into
place) only once the folder holding it is (``fsync_dir``). ``fsync_tree`` does both for
every file and folder under a folder written completely, before it is renamed into place.

The rollout log (``relay.buffer.rollout_log``) syncs its folder at each checkpoint; the
learner's checkpoints and final model (``relay.learner.checkpoint_files``,
``relay.learner.checkpoint``, ``relay.learner.hf_export``) sync theirs before they commit
them. It lives in the buffer, the lowest layer that both may import.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make the entries of ``folder`` (files created, renamed or removed in it) durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(folder: Path) -> None:
    """Make every file under ``folder``, and every folder's entries, durable."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as written:
                os.fsync(written.fileno())
        fsync_dir(Path(root))
