"""relay.configs.hub: a Hub ID resolves to its snapshot in the local cache, with no network;
one that is not there is refused saying it looks like a Hub ID, naming the cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest

from relay.configs.hub import looks_like_hub_id, resolve_hub_id

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def fill(cache: Path, repo_id: str, model: Path) -> Path:
    """``model``'s files in ``cache`` as huggingface_hub lays out ``repo_id``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(model, repo / "snapshots" / REVISION)
    return repo / "snapshots" / REVISION


@pytest.mark.parametrize(("value", "hub"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("meta-llama/Llama-3.2-1B", True),
    ("./Qwen/Qwen2.5", False), ("/models/qwen", False), ("models/qwen/v1", False),
    ("../a", False), ("qwen", False), ("builtin:tiny-arith", False), ("~/m/q", False),
])
def test_a_hub_id_is_told_from_a_path(value: str, hub: bool) -> None:
    assert looks_like_hub_id(value) is hub


def test_a_cached_model_resolves_to_its_snapshot_folder(cache: Path,
                                                       random_model_dir: Path) -> None:
    snapshot = fill(cache, "Org/Tiny", random_model_dir)
    assert Path(resolve_hub_id("Org/Tiny")) == snapshot
    assert (snapshot / "config.json").is_file()


def test_a_model_not_in_the_cache_is_refused_offline(cache: Path) -> None:
    with pytest.raises(ValueError) as error:
        resolve_hub_id("Org/Missing")
    assert "'Org/Missing' looks like a Hub ID" in str(error.value)
    assert f"HF_HUB_CACHE={cache}" in str(error.value) and "HF_HUB_OFFLINE" in str(error.value)


def test_online_a_failed_download_is_reported(cache: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    real = huggingface_hub.snapshot_download
    asked = []

    def no_network(repo_id: str, **kwargs: object) -> str:
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        asked.append(kwargs)
        raise OSError("no network in tests")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(ValueError) as error:
        resolve_hub_id("Org/Missing")
    assert asked and asked[0]["cache_dir"] == str(cache)
    assert "looks like a Hub ID" in str(error.value)
    assert "downloading it failed (OSError: no network in tests)" in str(error.value)
