"""Loading a ``torch.distributed.checkpoint`` folder without running code it holds.

DCP's ``FileSystemReader`` unpickles ``.metadata`` and its ``DefaultLoadPlanner`` loads every
non-tensor value (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``:
whoever can write the folder could run code in the learner. ``load`` reads ``.metadata``
with an unpickler that builds only DCP's metadata classes and the torch types they hold
(``METADATA_GLOBALS``), and non-tensor values with ``torch.load(weights_only=True)``; any
other global is refused with a ``CheckpointError`` naming the file. Tensors DCP already
reads with ``weights_only=True``. torch 2.11 to 2.13 write and read ``.metadata`` the same
way (``FileSystemReader.read_metadata``, ``metadata.py`` unchanged but for a type alias).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint import filesystem, metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from relay.learner.checkpoint_files import CheckpointError


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a ``.metadata`` that DCP wrote names: the classes of ``metadata.py`` and
    ``filesystem._StorageInfo`` (dataclasses rebuilt field by field), ``torch.Size``, the
    dtypes, a layout by name and the path a checkpoint id may be."""
    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name)
        for name in ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                     "_MEM_FORMAT_ENCODING")}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update({("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    for module in ("pathlib", "pathlib._local"):  # PosixPath's module from Python 3.13 on
        allowed[(module, "PosixPath")] = pathlib.PosixPath
    return allowed


METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: refused: it asks to build {module}.{name}, which is not one of "
                "torch.distributed.checkpoint's metadata types. DCP never writes that; "
                "unpickling it would run code of whoever wrote the file. Resume only from "
                "checkpoints this user wrote") from None


def read_metadata(file: IO[bytes], path: str) -> metadata.Metadata:
    """The ``Metadata`` pickled in ``file`` (read from ``path``), built from
    ``METADATA_GLOBALS`` only."""
    try:
        loaded = _MetadataUnpickler(file, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a torn file, or allowed types called with arguments DCP never
        raise CheckpointError(f"{path}: unreadable checkpoint metadata: {exc!r}") from exc
    if not isinstance(loaded, metadata.Metadata):
        raise CheckpointError(f"{path}: holds a {type(loaded).__name__}, not DCP's Metadata")
    return loaded


class RestrictedReader(filesystem.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` unpickles with ``read_metadata`` above;
    the rest (``storage_meta``, ``load_id``) as torch's own."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            loaded = read_metadata(stream, str(path))
        if getattr(loaded, "storage_meta", None) is None:
            loaded.storage_meta = metadata.StorageMeta()
        loaded.storage_meta.load_id = self.load_id
        return loaded


class RestrictedPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose ``load_bytes`` loads non-tensor values with
    ``weights_only=True`` (numbers, strings, tuples, dicts, tensors: what an optimizer's
    state holds) and stores them as torch's own does; ``folder`` names the checkpoint in
    its errors."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            raise CheckpointError(
                f"{self.folder}: value {fqn!r} refused: it asks to build "
                f"{refused.group(1) if refused else 'a type torch.load(weights_only=True) refuses'}"
                ", which an optimizer's state never holds; unpickling it would run code of "
                "whoever wrote the file. Resume only from checkpoints this user wrote") from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(state: dict[str, Any], folder: str) -> None:
    """``dcp.load(state, checkpoint_id=folder)`` with the restricted reader and planner (a
    collective: call on every rank). The metadata is read once here first, and a value the
    planner refuses is taken out of DCP's per-rank failures, so that either is a
    ``CheckpointError`` of its own (naming the folder) on every rank; DCP's other failures
    (tensors that do not fit) stay a ``CheckpointException``."""
    reader = RestrictedReader(folder)
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=RestrictedPlanner(folder))
    except CheckpointException as exc:  # every rank's failures: a refused value is named
        refused = [error for error, _trace in exc.failures.values()
                   if isinstance(error, CheckpointError)]
        if refused:
            raise refused[0] from exc
        raise
