"""Load a user's reward function from ``"module:function"`` or ``"path/to/file.py:function"``.

The function must have verl's signature, ``compute_score(data_source, solution_str,
ground_truth, extra_info) -> float | dict`` (verl's ``custom_reward_function.path`` and
``.name`` map to ``f"{path}:{name}"``). Every failure raises ``RewardLoadError`` with a
message naming what was asked for: a missing file or module, an import that raised, a
missing attribute (listing the callables the module does define), or a non-callable.

A spec is treated as a file path when its left part ends in ``.py`` or contains a path
separator; otherwise it is a dotted module name imported from ``sys.path``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from relay.algorithms.rewards.result import ScoreFn, describe


class RewardLoadError(Exception):
    """A custom reward function could not be loaded; the message says which and why."""


def _split(spec: str) -> tuple[str, str]:
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise RewardLoadError(
            f"custom reward function {spec!r}: expected 'module:function' or "
            "'path/to/file.py:function'"
        )
    return location, name


def _is_path(location: str) -> bool:
    return location.endswith(".py") or os.sep in location or "/" in location


def _import_file(location: str, spec: str) -> ModuleType:
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise RewardLoadError(f"custom reward function {spec!r}: file not found: {path}")
    # A unique module name per file, so two reward files called reward.py do not collide.
    digest = hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    module_name = f"relay_custom_reward_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardLoadError(f"custom reward function {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # report any import failure
        del sys.modules[module_name]
        raise _import_failed(spec, str(path), exc) from exc
    return module


def _import_module(location: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if location == missing or location.startswith(missing + "."):
            raise RewardLoadError(
                f"custom reward function {spec!r}: module {location!r} not found on "
                "sys.path (give a file path 'path/to/file.py:function' instead?)"
            ) from exc
        raise _import_failed(spec, f"module {location!r}", exc) from exc
    except (Exception, SystemExit) as exc:  # report any import failure
        raise _import_failed(spec, f"module {location!r}", exc) from exc


def _import_failed(spec: str, what: str, exc: BaseException) -> RewardLoadError:
    return RewardLoadError(
        f"custom reward function {spec!r}: importing {what} raised {describe(exc)}"
    )


def load_score_fn(spec: str) -> ScoreFn:
    """Import the module or file named by ``spec`` and return its reward function."""
    location, name = _split(spec)
    module = _import_file(location, spec) if _is_path(location) else _import_module(location, spec)
    if not hasattr(module, name):
        defined = sorted(
            attr for attr, value in vars(module).items()
            if callable(value) and not attr.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        )
        raise RewardLoadError(
            f"custom reward function {spec!r}: {location} has no attribute {name!r}; "
            f"functions it defines: {', '.join(defined) or 'none'}"
        )
    fn: ScoreFn = getattr(module, name)
    if not callable(fn):
        raise RewardLoadError(
            f"custom reward function {spec!r}: {location}:{name} is a "
            f"{type(fn).__name__}, not a function"
        )
    return fn
