"""Reading a DCP folder runs no code it holds: a ``.metadata`` or a non-tensor value whose
pickle asks to call anything but DCP's metadata types is refused with a ``CheckpointError``
naming it, before the call happens, while a folder DCP wrote loads as ``dcp.load`` loads it.
Each hostile case first shows, with a plain unpickler, that its payload does run."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from relay.learner import safe_dcp
from relay.learner.checkpoint_files import CheckpointError

pytestmark = pytest.mark.usefixtures("one_rank_group")


def write_marker(path: str) -> str:
    """What a hostile pickle calls: it leaves ``path`` behind as proof that it ran."""
    Path(path).write_text("ran")
    return "ran"


class Payload:
    """Unpickles by calling ``write_marker(marker)``, like a ``__reduce__`` exploit."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return write_marker, (str(self.marker),)


def state() -> dict:
    """A state dict shaped like an optimizer's: tensors and plain non-tensor values."""
    return {"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "step": torch.tensor(4.0),
            "hyper": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw", "fused": None}}


def test_a_folder_dcp_wrote_loads_as_dcp_loads_it(tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path))
    loaded = {"weight": torch.zeros(2, 3), "step": torch.tensor(0.0),
              "hyper": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "fused": False}}
    safe_dcp.load(loaded, str(tmp_path))
    assert torch.equal(loaded["weight"], state()["weight"])
    assert loaded["step"].item() == 4.0
    assert loaded["hyper"] == {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw",
                               "fused": None}
    with open(tmp_path / ".metadata", "rb") as stream:
        metadata = safe_dcp.read_metadata(stream, "m")
    assert set(metadata.state_dict_metadata) == {"weight", "step", "hyper.lr", "hyper.betas",
                                                 "hyper.name", "hyper.fused"}


def test_a_metadata_pickle_that_calls_a_function_is_refused_without_calling_it(
        tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "dcp"))
    hostile = pickle.dumps(Payload(tmp_path / "ran-by-plain-pickle"))
    pickle.loads(hostile)  # the payload is live: a plain unpickler runs it
    assert (tmp_path / "ran-by-plain-pickle").read_text() == "ran"

    marker = tmp_path / "ran-by-the-learner"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata: refused: it asks to build "
                                              r"tests\.learner\.test_safe_dcp\.write_marker"):
        safe_dcp.load(state(), str(tmp_path / "dcp"))
    with pytest.raises(CheckpointError, match="refused"):
        with open(tmp_path / "dcp" / ".metadata", "rb") as stream:
            safe_dcp.read_metadata(stream, str(tmp_path / "dcp" / ".metadata"))
    assert not marker.exists()


def test_a_metadata_of_allowed_types_that_is_not_dcps_metadata_is_refused(
        tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(torch.Size([2, 3])))
    with open(path, "rb") as stream, pytest.raises(CheckpointError,
                                                   match="holds a Size, not DCP's Metadata"):
        safe_dcp.read_metadata(stream, str(path))
    path.write_bytes(pickle.dumps(torch.Size([2, 3]))[:-3])  # torn
    with open(path, "rb") as stream, pytest.raises(CheckpointError,
                                                   match="unreadable checkpoint metadata"):
        safe_dcp.read_metadata(stream, str(path))


def test_a_non_tensor_value_that_calls_a_function_is_refused_without_calling_it(
        tmp_path: Path) -> None:
    plain, marker = tmp_path / "ran-by-plain-dcp", tmp_path / "ran-by-the-learner"
    dcp.save({"weight": torch.ones(2), "hyper": Payload(plain)},
             checkpoint_id=str(tmp_path / "plain"))
    dcp.load({"weight": torch.zeros(2), "hyper": None}, checkpoint_id=str(tmp_path / "plain"))
    assert plain.read_text() == "ran"  # the payload is live: DCP's own planner runs it

    dcp.save({"weight": torch.ones(2), "hyper": Payload(marker)},
             checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(CheckpointError, match=r"dcp: value .hyper. refused: it asks to build "
                                              r"tests\.learner\.test_safe_dcp\.write_marker"):
        safe_dcp.load({"weight": torch.zeros(2), "hyper": None}, str(tmp_path / "dcp"))
    assert not marker.exists()
