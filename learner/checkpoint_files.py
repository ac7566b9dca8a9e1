"""A checkpoint folder's files: whose they are, who may write them, and whether they are
still the bytes the learner wrote.

A checkpoint is code the learner trusts (``relay.learner.safe_dcp`` refuses the pickles it does not
expect, but a folder another user can write could still swap in other weights), so a run
resumes only from a folder that belongs to its user and that neither the group nor others
can write (``check_owner_and_mode``; ``tighten_modes`` makes every checkpoint so, whatever
the umask). ``write_durably`` replaces a file so that a crash leaves the old one or the new
one whole.

The manifest (``manifest``, stored in ``meta.json``) holds each file's size and SHA-256;
``verify_manifest`` finds the first file that differs. SHA-256 costs 0.52 s of CPU per GiB
(1.9 GiB/s on one core of an AMD EPYC with SHA instructions, measured with hashlib on
page-cached data): a 7B policy's checkpoint (about 104 GiB: float32 weights and two Adam
moments in ``dcp/``, float32 weights in ``hf/``) costs about 54 s of CPU, spread over the
ranks when it is written (7 s each on 8) and over up to ``VERIFY_THREADS`` threads when it is
verified; reading the files back from a disk that no longer caches them costs more. This
module knows nothing of what the files hold.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import msgspec

from relay.buffer.durable import fsync_dir

VERIFY_THREADS = 8  # hashlib releases the GIL while it hashes a file
GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH

REPLACED_SUFFIX = ".replaced"  # a folder moved aside while its replacement takes its name


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit the run (the message names it)."""


class FileDigest(msgspec.Struct, kw_only=True, frozen=True):
    """One file of a checkpoint as it was written: its size in bytes and its SHA-256."""

    size: int
    sha256: str


def digest_file(path: Path) -> FileDigest:
    sha256 = hashlib.sha256()
    with open(path, "rb") as data:  # read in chunks: hashlib.file_digest is Python 3.11+
        for chunk in iter(lambda: data.read(1 << 20), b""):
            sha256.update(chunk)
        return FileDigest(size=os.fstat(data.fileno()).st_size, sha256=sha256.hexdigest())


def listed_files(folder: Path, leave_out: Iterable[str] = ()) -> list[str]:
    """Every regular file under ``folder`` as a relative POSIX path, sorted, but those
    named in ``leave_out``."""
    skipped = set(leave_out)
    names = [PurePosixPath(Path(root, name).relative_to(folder)).as_posix()
             for root, _dirs, files in os.walk(folder) for name in files]
    return sorted(name for name in names if name not in skipped)


def manifest(folder: Path, names: Iterable[str]) -> dict[str, FileDigest]:
    """The digest of each of ``names`` (relative paths under ``folder``)."""
    return {name: digest_file(folder / name) for name in names}


def verify_manifest(folder: Path, files: dict[str, FileDigest]) -> None:
    """``CheckpointError`` naming the first file of ``files`` that is missing, of another
    size or of other bytes than its digest (sizes are checked first: they cost nothing).
    Files the manifest does not list are not looked at."""
    for name in sorted(files):
        path = _inside(folder, name)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing, but {folder}'s meta.json lists it: "
                                  f"{_DAMAGED}") from None
        if size != files[name].size:
            raise CheckpointError(f"{path}: {size} bytes, but {folder}'s meta.json recorded "
                                  f"{files[name].size}: {_DAMAGED}")
    with ThreadPoolExecutor(min(VERIFY_THREADS, max(len(files), 1))) as pool:
        digests = dict(zip(sorted(files), pool.map(lambda name: digest_file(folder / name),
                                                   sorted(files))))
    for name, digest in digests.items():
        if digest.sha256 != files[name].sha256:
            raise CheckpointError(f"{folder / name}: its SHA-256 differs from the one "
                                  f"{folder}'s meta.json recorded: {_DAMAGED}")


_DAMAGED = ("the checkpoint is damaged (a disk, copy or transfer fault); resume from another "
            "one (trainer.resume_mode=auto falls back to the newest valid one)")


def _inside(folder: Path, name: str) -> Path:
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise CheckpointError(f"{folder}/meta.json: lists {name!r}, which is not a path "
                              "inside the checkpoint folder")
    return folder / relative


def write_durably(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, and rename into place."""
    temporary = path.with_name(path.name + ".partial")
    with open(temporary, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def replace_folder(partial: Path, folder: Path) -> None:
    """Rename the completely written ``partial`` into place as ``folder``: a ``folder``
    already there is moved aside to ``<folder>.replaced`` first and removed last, so a crash
    leaves the old folder or the new one whole, never half of either."""
    replaced = folder.with_name(folder.name + REPLACED_SUFFIX)
    if replaced.exists():  # left by a crash between the two renames
        shutil.rmtree(replaced)
    if folder.exists():
        os.replace(folder, replaced)
    os.replace(partial, folder)
    fsync_dir(folder.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def check_owner_and_mode(checkpoint: Path) -> None:
    """``CheckpointError`` unless ``checkpoint`` and everything under it belong to this
    process's user and are not writable by the group or others, and nothing under it is a
    symbolic link: who can write a checkpoint chooses what the learner loads."""
    uid = os.geteuid()
    for path, info in _tree(checkpoint):
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(f"{path}: a symbolic link inside checkpoint {checkpoint}; "
                                  "a checkpoint holds its own files: copy the target in its "
                                  "place")
        if info.st_uid != uid:
            raise CheckpointError(f"{path}: owned by {_user(info.st_uid)}, not by "
                                  f"{_user(uid)} who resumes from it; whoever can write a "
                                  f"checkpoint chooses what the learner loads. If you trust "
                                  f"it, take it over: chown -R {_user(uid)} {checkpoint}")
        if info.st_mode & GROUP_OR_OTHER_WRITE:
            raise CheckpointError(f"{path}: writable by its group or by others (mode "
                                  f"{stat.S_IMODE(info.st_mode):o}); whoever can write a "
                                  f"checkpoint chooses what the learner loads. Fix: chmod -R "
                                  f"go-w {checkpoint}")


def tighten_modes(folder: Path) -> None:
    """Clear the group and other write bits of ``folder`` and everything under it (a
    umask of 002 leaves them set), so that ``check_owner_and_mode`` passes."""
    for path, info in _tree(folder):
        if info.st_mode & GROUP_OR_OTHER_WRITE and not stat.S_ISLNK(info.st_mode):
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~GROUP_OR_OTHER_WRITE)


def _tree(folder: Path) -> Iterable[tuple[Path, os.stat_result]]:
    """``folder`` (through a link to it) and each path under it (not followed)."""
    yield folder, folder.stat()
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            yield path, path.lstat()


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
