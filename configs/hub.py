"""A model path given as a Hugging Face Hub ID (``model.path = "Qwen/Qwen2.5-0.5B-Instruct"``).

``looks_like_hub_id`` tells such a value from a local path (``ORG/NAME``, no leading ``.``,
``/`` or ``~``, not an existing folder); ``resolve_hub_id`` turns it into a local folder once,
at launch, so that every process of the run (learner, generators, critic, reward model,
tokenizer) loads the same files: the Hugging Face cache first
(``snapshot_download(local_files_only=True)``, in ``HF_HUB_CACHE``), then a download of the
model's files into that cache unless ``HF_HUB_OFFLINE`` is set. The launcher records the
snapshot folder in the run's resolved ``run.toml``.
"""

from __future__ import annotations

import os
import re
import sys

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja"]
"""What a download fetches of a repository: the weights as safetensors, the configs and the
tokenizer's files (not the copies in other formats many repositories also hold)."""
TRUE = ("1", "on", "true", "yes")


def looks_like_hub_id(value: str) -> bool:
    """``ORG/NAME`` as the Hub spells a repository (``Qwen/Qwen2.5-0.5B-Instruct``)."""
    return HUB_ID.fullmatch(value) is not None and ".." not in value


def hub_cache() -> str:
    """The Hugging Face cache folder, read now (``huggingface_hub.constants`` reads the
    environment once, at import): ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids a download (read now, as ``hub_cache``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def resolve_hub_id(repo_id: str) -> str:
    """The local snapshot folder of Hub model ``repo_id``: from the cache, else downloaded
    (``MODEL_FILES``) unless ``HF_HUB_OFFLINE`` is set. ``ValueError`` saying that the value
    looks like a Hub ID and why it has no local folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    where = (f"{repo_id!r} looks like a Hub ID, but it is neither a local folder nor in the "
             f"Hugging Face cache (HF_HUB_CACHE={cache})")
    if hub_offline():
        raise ValueError(f"{where}, and HF_HUB_OFFLINE is set: download it first (hf download "
                         f"{repo_id}), point HF_HUB_CACHE at a cache holding it, or give a "
                         "local folder saved with save_pretrained")
    print(f"relay launch: downloading {repo_id} from the Hugging Face Hub into {cache}",
          file=sys.stderr, flush=True)
    try:
        return snapshot_download(repo_id, cache_dir=cache, allow_patterns=MODEL_FILES)
    except Exception as exc:  # noqa: BLE001 - any failure of the download is reported as is
        raise ValueError(f"{where}, and downloading it failed ({type(exc).__name__}: {exc}); "
                         "check the name, your network and HF_TOKEN for a gated model, or give "
                         "a local folder saved with save_pretrained") from exc
