"""A checkpoint folder's files: one that another user owns, that the group or others can
write, or that holds a symbolic link is refused naming the command that fixes it; a written
checkpoint is made so whatever the umask; the manifest finds a flipped byte, a cut file, a
missing file and a path out of the folder, naming each."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from relay.learner.checkpoint_files import (
    CheckpointError,
    FileDigest,
    check_owner_and_mode,
    listed_files,
    manifest,
    tighten_modes,
    verify_manifest,
    write_durably,
)


def checkpoint(folder: Path) -> Path:
    """A small checkpoint-like tree: a file at the top and one a folder down."""
    (folder / "dcp").mkdir(parents=True)
    (folder / "meta.json").write_text("{}")
    (folder / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    for path in (folder, folder / "dcp"):
        path.chmod(0o755)
    return folder


def test_a_folder_of_this_user_that_only_it_can_write_passes(tmp_path: Path) -> None:
    check_owner_and_mode(checkpoint(tmp_path / "step-1"))


@pytest.mark.parametrize("where", ["", "dcp", "dcp/__0_0.distcp"])
@pytest.mark.parametrize("bits", [stat.S_IWGRP, stat.S_IWOTH])
def test_anything_the_group_or_others_can_write_is_refused_naming_the_chmod(
        tmp_path: Path, where: str, bits: int) -> None:
    folder = checkpoint(tmp_path / "step-1")
    loose = folder / where
    loose.chmod(stat.S_IMODE(loose.stat().st_mode) | bits)
    with pytest.raises(CheckpointError) as error:
        check_owner_and_mode(folder)
    assert str(error.value).startswith(f"{loose}: writable by its group or by others")
    assert str(error.value).endswith(f"Fix: chmod -R go-w {folder}")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_another_user_owns_is_refused_naming_the_chown(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "step-1")
    os.chown(folder / "dcp" / "__0_0.distcp", 12345, 12345)
    with pytest.raises(CheckpointError) as error:
        check_owner_and_mode(folder)
    assert str(error.value).startswith(f"{folder / 'dcp' / '__0_0.distcp'}: owned by uid "
                                       "12345, not by root who resumes from it")
    assert str(error.value).endswith(f"take it over: chown -R root {folder}")


def test_a_foreign_owner_is_refused_as_any_user_sees_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check for a user who is not root: the files are another uid's."""
    folder = checkpoint(tmp_path / "step-1")
    monkeypatch.setattr(os, "geteuid", lambda: folder.stat().st_uid + 54321)
    with pytest.raises(CheckpointError, match=f"{folder}: owned by .*, not by uid "
                                              f"{folder.stat().st_uid + 54321} who resumes"):
        check_owner_and_mode(folder)


def test_a_symbolic_link_inside_is_refused(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "step-1")
    (tmp_path / "elsewhere").write_text("x")
    (folder / "dcp" / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"dcp/linked: a symbolic link inside checkpoint"):
        check_owner_and_mode(folder)


def test_tightened_modes_pass_under_a_loose_umask(tmp_path: Path) -> None:
    previous = os.umask(0o002)
    try:
        folder = tmp_path / "step-1"
        (folder / "dcp").mkdir(parents=True)
        (folder / "dcp" / "shard").write_bytes(b"x")
    finally:
        os.umask(previous)
    with pytest.raises(CheckpointError, match="writable by its group"):
        check_owner_and_mode(folder)
    tighten_modes(folder)
    check_owner_and_mode(folder)
    assert stat.S_IMODE((folder / "dcp" / "shard").stat().st_mode) == 0o644
    assert stat.S_IMODE((folder / "dcp").stat().st_mode) == 0o755


def test_the_manifest_holds_each_files_size_and_sha256(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "step-1")
    (folder / "writer.json").write_text("{}")
    names = listed_files(folder, ["writer.json"])
    assert names == ["dcp/__0_0.distcp", "meta.json"]
    digests = manifest(folder, names)
    shard = (folder / "dcp" / "__0_0.distcp").read_bytes()
    assert digests["dcp/__0_0.distcp"] == FileDigest(size=1024,
                                                     sha256=hashlib.sha256(shard).hexdigest())
    verify_manifest(folder, digests)


def test_a_flipped_byte_a_cut_file_and_a_missing_file_are_named(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "step-1")
    digests = manifest(folder, listed_files(folder))
    shard = folder / "dcp" / "__0_0.distcp"
    original = shard.read_bytes()

    flipped = bytearray(original)
    flipped[700] ^= 0x01
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=rf"^{shard}: its SHA-256 differs from the one "
                                              rf"{folder}'s meta.json recorded: the checkpoint "
                                              "is damaged"):
        verify_manifest(folder, digests)

    shard.write_bytes(original[:-1])
    with pytest.raises(CheckpointError, match=rf"^{shard}: 1023 bytes, but {folder}'s "
                                              "meta.json recorded 1024"):
        verify_manifest(folder, digests)

    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"^{shard}: missing, but {folder}'s meta.json "
                                              "lists it"):
        verify_manifest(folder, digests)


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", ""])
def test_a_manifest_entry_outside_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    folder = checkpoint(tmp_path / "step-1")
    with pytest.raises(CheckpointError, match="which is not a path inside the checkpoint"):
        verify_manifest(folder, {name: FileDigest(size=0, sha256="")})


def test_a_durable_write_replaces_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    target.write_text("old")
    write_durably(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]
