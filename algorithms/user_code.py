"""Load a user's function from ``"module:function"`` or ``"path/to/file.py:function"``.

A spec is a file path when its left part ends in ``.py`` or contains a path separator;
otherwise a dotted module name imported from ``sys.path``. A file is imported once per
process under a name unique to its resolved path, so two files called ``losses.py`` do not
collide and a file named by two keys (a reward and a loss) runs its decorators once. Every
failure raises the caller's error type with a message that starts with what was asked for
(``what``, e.g. "custom reward function") and says why: a missing file or module, an import
that raised, a missing attribute (listing the callables the module defines), a non-callable.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


class UserCodeError(Exception):
    """A user's function could not be loaded; the message says which and why."""


def is_spec(value: str) -> bool:
    """Whether ``value`` names a function by path (``module:function``, ``file.py:function``)
    rather than a registered name."""
    location, sep, name = value.rpartition(":")
    return bool(sep and location and name)


def is_file(location: str) -> bool:
    """Whether a spec's left part is a file path rather than a module name."""
    return location.endswith(".py") or os.sep in location or "/" in location


def load_function(spec: str, what: str,
                  error: type[Exception] = UserCodeError) -> Callable[..., Any]:
    """Import the module or file that ``spec`` names and return its function; failures raise
    ``error`` with a message that starts with ``what`` and ``spec``."""
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise error(f"{what} {spec!r}: expected 'module:function' or "
                    "'path/to/file.py:function'")
    module = (_import_file(location, spec, what, error) if is_file(location)
              else _import_module(location, spec, what, error))
    if not hasattr(module, name):
        defined = sorted(
            attr for attr, value in vars(module).items()
            if callable(value) and not attr.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        )
        raise error(f"{what} {spec!r}: {location} has no attribute {name!r}; "
                    f"functions it defines: {', '.join(defined) or 'none'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise error(f"{what} {spec!r}: {location}:{name} is a {type(fn).__name__}, "
                    "not a function")
    return fn


def _import_file(location: str, spec: str, what: str, error: type[Exception]) -> ModuleType:
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise error(f"{what} {spec!r}: file not found: {path}")
    digest = hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    module_name = f"relay_user_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # report any import failure
        del sys.modules[module_name]
        raise error(f"{what} {spec!r}: importing {path} raised {describe(exc)}") from exc
    return module


def _import_module(location: str, spec: str, what: str, error: type[Exception]) -> ModuleType:
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if location == missing or location.startswith(missing + "."):
            raise error(f"{what} {spec!r}: module {location!r} not found on sys.path (give "
                        "a file path 'path/to/file.py:function' instead?)") from exc
        raise error(f"{what} {spec!r}: importing module {location!r} raised "
                    f"{describe(exc)}") from exc
    except (Exception, SystemExit) as exc:  # report any import failure
        raise error(f"{what} {spec!r}: importing module {location!r} raised "
                    f"{describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """``TypeName: message``, even for an exception whose ``str`` itself raises."""
    try:
        message = str(exc)
    except Exception:  # a user's exception class may be broken
        message = "<unprintable message>"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
