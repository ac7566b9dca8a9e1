"""Load TOML configs into the typed schemas, apply ``key.sub=value`` overrides, explain errors.

Every failure is a ``ConfigError`` that names where the bad value came from (the file, or
"command line"), the key path (``actor.optim.lr``, ``generators[0].engine``) and what was
expected; an unknown key suggests the closest valid one. Relative paths in a file are resolved
against that file's folder, relative paths given on the command line against the working
directory.

A schema may accept another project's name for a section (an alias, e.g. verl's
``algorithm.filter_groups`` for ``buffer.filter_groups``), in the file and on the command
line, and another project's keys that it lacks (``ForeignKeys``, e.g. ``relay.configs.verl_keys``):
each such key, in the file or on the command line, is translated into the keys it stands for,
dropped, or refused by the translator; one of its keys that the schema has, given ``null`` on
the command line, takes the schema's default. Hydra's ``+key=value`` and ``++key=value`` read
as ``key=value``. This module knows TOML and the schemas' shapes; it does not know what the keys
mean beyond the few cross-key checks in ``relay.configs.checks``.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
from msgspec import inspect as mi

from relay.algorithms.user_code import is_file, is_spec
from relay.configs.hub import looks_like_hub_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package (a dependency there)
    import tomli as tomllib

T = TypeVar("T", bound=msgspec.Struct)
KeyPath = tuple[str, ...]

COMMAND_LINE = "command line"
NULLS = ("null", "None", "~")  # YAML's and Hydra's spellings of no value


class ForeignKeys(Protocol):
    """Another project's keys that a schema lacks, and what each stands for."""

    def known(self) -> Iterable[KeyPath]:
        """Every key path it recognises (for did-you-mean)."""
        ...

    def translate(self, parts: KeyPath, value: Any,
                  source: str) -> list[tuple[KeyPath, Any]] | None:
        """The schema keys and values ``parts = value`` stands for ([]: none, the key has
        no effect), or None when ``parts`` is not one of its keys; raises ``ConfigError``
        for a key or value it refuses."""
        ...


class ConfigError(ValueError):
    """A config problem: ``source`` (file or "command line"), ``key`` path, what is wrong."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source, self.key, self.problem = source, key, problem
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")


# ---------------------------------------------------------------------------------------
# Key paths: "a.b[0].c" <-> ("a", "b", 0, "c")
# ---------------------------------------------------------------------------------------

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def parse_key(key: str) -> tuple[str | int, ...]:
    """Split ``a.b[0].c`` (or ``a.b.0.c``) into ``("a", "b", 0, "c")``."""
    parts: list[str | int] = []
    for name, index in _PART.findall(key):
        parts.append(int(index) if index else int(name) if name.isdigit() else name)
    if not parts or "".join(_PART.sub("", key).split(".")):
        raise ValueError(f"malformed key {key!r}")
    return tuple(parts)


def format_key(parts: Sequence[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


# ---------------------------------------------------------------------------------------
# Describing schema types to people
# ---------------------------------------------------------------------------------------


def _unwrap(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


def describe(t: mi.Type) -> str:
    """A phrase for what a schema type accepts, e.g. "an integer > 0"."""
    t = _unwrap(t)
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, (mi.IntType, mi.FloatType)):
        noun = "an integer" if isinstance(t, mi.IntType) else "a number"
        bounds = [f"{op} {v}" for op, v in (("> ", t.gt), (">=", t.ge), ("< ", t.lt), ("<=", t.le))
                  if v is not None]
        return noun + (" " + " and ".join(b.replace("  ", " ") for b in bounds) if bounds else "")
    if isinstance(t, mi.StrType):
        return "a string"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in t.values)
    if isinstance(t, mi.ListType):
        size = ""
        if t.min_length is not None and t.min_length == t.max_length:
            size = f" of exactly {t.min_length}"
        elif t.min_length:
            size = f" of at least {t.min_length}"
        return f"a list{size} of {describe(t.item_type).removeprefix('a ').removeprefix('an ')}s"
    if isinstance(t, mi.UnionType):
        return " or ".join(describe(u) for u in t.types)
    if isinstance(t, mi.StructType):
        return "a table"
    if isinstance(t, mi.DictType):
        return "a table of names (key.name=value each, or a TOML inline table {name = value})"
    if isinstance(t, mi.NoneType):
        return "null (unset)"
    return type(t).__name__


def _struct_fields(t: mi.Type) -> dict[str, mi.Field] | None:
    t = _unwrap(t)
    return {f.name: f for f in t.fields} if isinstance(t, mi.StructType) else None


def type_at(root: type[msgspec.Struct], parts: Sequence[str | int]) -> mi.Type:
    """The schema type at a key path; raises KeyError naming the first unknown part. Below a
    table of free names (a ``dict[str, ...]`` field: ``custom_reward_function.reward_kwargs``)
    any name is a key, of the table's value type."""
    t: mi.Type = mi.type_info(root)
    for depth, part in enumerate(parts):
        t = _unwrap(t)
        if isinstance(t, mi.DictType) and isinstance(part, str):
            t = t.value_type
            continue
        if isinstance(part, int):
            if not isinstance(t, mi.ListType):
                raise KeyError(depth)
            t = t.item_type
            continue
        fields = _struct_fields(t)
        if fields is None or part not in fields:
            raise KeyError(depth)
        t = fields[part].type
    return t


def _key_paths(t: mi.Type, prefix: tuple[str | int, ...] = ()) -> Iterable[tuple[str | int, ...]]:
    """Every key path of the schema, sections included (leaves after their section)."""
    fields = _struct_fields(t)
    if fields is None:
        inner = _unwrap(t)
        if isinstance(inner, mi.ListType) and _struct_fields(inner.item_type):
            yield from _key_paths(inner.item_type, prefix + (0,))
        else:
            yield prefix
        return
    if prefix:
        yield prefix
    for name, field in fields.items():
        yield from _key_paths(field.type, prefix + (name,))


def unknown_key_error(root: type[msgspec.Struct], source: str,
                      parts: Sequence[str | int], depth: int,
                      foreign: ForeignKeys | None = None) -> ConfigError:
    """An error for ``parts[depth]`` not being a key there, with the closest valid key
    (among the schema's and ``foreign``'s keys)."""
    known = set(foreign.known()) if foreign else set()
    prefixes = {k[:i] for k in known for i in range(1, len(k) + 1)}
    while depth + 1 < len(parts) and tuple(parts[: depth + 1]) in prefixes:
        depth += 1  # inside one of foreign's sections: blame the first part it lacks too
    parent = tuple(parts[:depth])
    bad = parts[depth]
    children = {k[depth] for k in prefixes if len(k) > depth and k[:depth] == parent}
    try:
        fields = _struct_fields(type_at(root, parent))
    except KeyError:
        fields = {}
    key = format_key(parts[: depth + 1])
    if fields is None and not children:
        return ConfigError(source, key, f"{format_key(parent)} has no sub-keys")
    valid = sorted(set(fields or {}) | {str(c) for c in children})
    hint = ""
    close = difflib.get_close_matches(str(bad), valid, n=1, cutoff=0.6)
    if close:
        hint = f"; did you mean {format_key(parent + (close[0],))!r}?"
    else:
        elsewhere = [p for p in [*_key_paths(mi.type_info(root)), *sorted(known)]
                     if p and p[-1] == bad]
        if elsewhere:
            hint = f"; did you mean {format_key(elsewhere[0])!r}?"
    section = f"[{format_key(parent)}]" if parent else "the top level"
    return ConfigError(source, key, f"unknown key{hint} (valid keys in {section}: "
                                    f"{', '.join(valid)})")


def check_unknown_keys(root: type[msgspec.Struct], data: Any, source: str,
                       parts: tuple[str | int, ...] = ()) -> None:
    """Raise a ``ConfigError`` with a suggestion for the first key the schema lacks."""
    t = _unwrap(type_at(root, parts))
    fields = _struct_fields(t)
    if fields is not None and isinstance(data, dict):
        for name, value in data.items():
            if name not in fields:
                raise unknown_key_error(root, source, parts + (name,), len(parts))
            check_unknown_keys(root, value, source, parts + (name,))
    elif isinstance(t, mi.ListType) and isinstance(data, list):
        for i, item in enumerate(data):
            check_unknown_keys(root, item, source, parts + (i,))


# ---------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------


def _wants_raw_string(t: mi.Type) -> bool:
    t = _unwrap(t)
    if isinstance(t, mi.StrType):
        return True
    if isinstance(t, mi.LiteralType):
        return all(isinstance(v, str) for v in t.values)
    return False


def coerce_override(root: type[msgspec.Struct], parts: Sequence[str | int], raw: str) -> Any:
    """Turn the text of ``key=value`` into a value of the key's schema type.

    Strings and string choices take the text as is; everything else is read as a TOML value
    (``3``, ``1e-6``, ``true``, ``["a.jsonl", "b.jsonl"]``); a list-or-string key takes a
    bare word as the string; a key that may be unset takes ``null`` (``NULLS``) as unset.
    """
    t = type_at(root, parts)
    if raw in NULLS and _accepts_none(t):
        return None
    if _wants_raw_string(t):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        inner = _unwrap(t)
        if isinstance(inner, mi.AnyType):
            return raw  # a free table's value: a bare word is a string
        if isinstance(inner, mi.UnionType) and any(_wants_raw_string(u) for u in inner.types):
            return raw
        bools = inner.types if isinstance(inner, mi.UnionType) else (inner,)
        if any(isinstance(u, mi.BoolType) for u in bools) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"  # Python's and Hydra's True / False too
        raise ConfigError(COMMAND_LINE, format_key(parts),
                          f"expected {describe(t)}, got {raw!r}") from None


def _set_path(data: dict[str, Any], parts: Sequence[str | int], value: Any, key: str) -> None:
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        nxt = parts[depth + 1]
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                have = len(node) if isinstance(node, list) else 0
                raise ConfigError(COMMAND_LINE, key, f"index {part} is out of range "
                                                     f"(the list has {have} entries)")
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    last = parts[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise ConfigError(COMMAND_LINE, key, f"index {last} is out of range")
        node[last] = value
    else:
        node[last] = value


def loose_value(raw: str) -> Any:
    """The value of a foreign key's text, whose type the schema does not know: a TOML value
    (``3``, ``true``, ``['console','wandb']``), None for ``null``, else the text."""
    if raw in NULLS:
        return None
    if raw.lower() in ("true", "false"):  # Python's and Hydra's True / False too
        return raw.lower() == "true"
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(root: type[msgspec.Struct], data: dict[str, Any],
                    overrides: Iterable[str],
                    aliases: Mapping[KeyPath, KeyPath] | None = None,
                    foreign: ForeignKeys | None = None) -> set[tuple[str | int, ...]]:
    """Apply ``key.sub=value`` strings to ``data`` in place; return the key paths touched.
    A key under an alias (see ``move_aliases``) is set under the key it stands for; a key
    the schema lacks is translated by ``foreign``."""
    touched: set[tuple[str | int, ...]] = set()
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key:
            raise ConfigError(COMMAND_LINE, text, "an override must look like section.key=value")
        try:
            parts = parse_key(key)
        except ValueError as exc:
            raise ConfigError(COMMAND_LINE, key, str(exc)) from None
        for alias, canonical in (aliases or {}).items():
            if parts[:len(alias)] == alias:
                parts = canonical + parts[len(alias):]
                key = format_key(parts)
        try:
            type_at(root, parts)
        except KeyError as exc:
            value = loose_value(raw.strip())
            targets = foreign.translate(parts, value, COMMAND_LINE) if foreign else None
            if targets is None:
                raise unknown_key_error(root, COMMAND_LINE, parts, exc.args[0],
                                        foreign) from None
            for target, target_value in targets:
                if target_value is value:  # as given: read it as the target's type
                    target_value = coerce_override(root, target, raw.strip())
                _set_path(data, target, target_value, format_key(target))
                touched.add(target)
            continue
        if raw.strip() in NULLS and foreign and parts in set(foreign.known()) \
                and not _accepts_none(type_at(root, parts)):
            _unset(data, parts)  # another project's "no value": the schema's default
            continue
        _set_path(data, parts, coerce_override(root, parts, raw.strip()), key)
        touched.add(parts)
    return touched


def _accepts_none(t: mi.Type) -> bool:
    inner = _unwrap(t)
    return isinstance(inner, mi.UnionType) and any(isinstance(u, mi.NoneType)
                                                   for u in inner.types)


def _unset(data: dict[str, Any], parts: Sequence[str | int]) -> None:
    """Remove ``parts`` from ``data`` if it is there, so the schema's default applies."""
    parent = _find(data, parts[:-1])
    if isinstance(parent, dict):
        parent.pop(parts[-1], None)


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------

_AT = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def _value_at(data: Any, parts: Sequence[str | int]) -> Any:
    for part in parts:
        data = data[part]
    return data


def explain_validation_error(root: type[msgspec.Struct], data: dict[str, Any],
                             exc: msgspec.ValidationError, source_of) -> ConfigError:
    """Turn msgspec's "Expected `int`, got `str` - at `$.a.b`" into a ``ConfigError``."""
    match = _AT.match(str(exc))
    assert match is not None
    problem, path = match["problem"], (match["path"] or "").lstrip(".")
    parts = parse_key(path) if path else ()
    missing = _MISSING.match(problem)
    if missing:
        parts = parts + (missing["field"],)
        expected = describe(type_at(root, parts))
        return ConfigError(source_of(parts), format_key(parts),
                           f"missing required key (expected {expected})")
    try:
        expected = describe(type_at(root, parts))
        got = _value_at(data, parts)
    except (KeyError, IndexError, TypeError):
        return ConfigError(source_of(parts), format_key(parts), problem)
    return ConfigError(source_of(parts), format_key(parts), f"expected {expected}, got {got!r}")


def to_toml(config: msgspec.Struct) -> bytes:
    """A config as TOML, which has no null: a key left unset (None) is left out, and reads
    back as unset."""
    def drop_none(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: drop_none(v) for k, v in node.items() if v is not None}
        return [drop_none(v) for v in node] if isinstance(node, list) else node

    return msgspec.toml.encode(drop_none(msgspec.to_builtins(config)))


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; errors name the file (and TOML's own line and column)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot be read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "", f"not valid TOML: {exc}") from None


def _find(data: dict[str, Any], parts: Sequence[str | int]) -> Any:
    node: Any = data
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _merge(into: dict[str, Any], subtree: dict[str, Any], at: KeyPath, alias: KeyPath,
           source: str) -> None:
    """Merge ``subtree`` (found under ``alias``) into ``into`` (the table at ``at``); a key
    set in both is an error."""
    for name, value in subtree.items():
        here = into.get(name)
        if isinstance(here, dict) and isinstance(value, dict):
            _merge(here, value, at + (name,), alias + (name,), source)
        elif name in into:
            raise ConfigError(source, format_key(alias + (name,)),
                              f"is another name for {format_key(at + (name,))}, which is "
                              "also set; keep one of them")
        else:
            into[name] = value


def move_aliases(data: dict[str, Any], aliases: Mapping[KeyPath, KeyPath], source: str) -> None:
    """Move each subtree found under an alias (another project's name for a section, e.g.
    verl's ``algorithm.filter_groups``) to the key it stands for, in place, merging it with
    what is there already; a table the move leaves empty is removed."""
    for alias, canonical in aliases.items():
        parent = _find(data, alias[:-1])
        if not isinstance(parent, dict) or alias[-1] not in parent:
            continue
        subtree = parent.pop(alias[-1])
        there = _find(data, canonical)
        if isinstance(there, dict) and isinstance(subtree, dict):
            _merge(there, subtree, canonical, alias, source)
        elif there is not None:
            raise ConfigError(source, format_key(alias),
                              f"is another name for {format_key(canonical)}, which is also "
                              "set; keep one of them")
        else:
            _set_path(data, canonical, subtree, format_key(canonical))
        if not parent and len(alias) > 1:
            _find(data, alias[:-2]).pop(alias[-2])


def _leaves(node: Any, prefix: KeyPath = ()) -> Iterable[tuple[KeyPath, Any]]:
    """(key path, value) of every value in nested tables that is not a non-empty table."""
    if isinstance(node, dict) and node:
        for name, value in node.items():
            yield from _leaves(value, prefix + (name,))
    elif prefix:
        yield prefix, node


def translate_foreign(root: type[msgspec.Struct], data: dict[str, Any], source: str,
                      foreign: ForeignKeys) -> None:
    """Replace, in place, each key of ``data`` the schema lacks by what ``foreign`` makes of
    it. A key the file also sets under the schema's name keeps that value (the explicit key
    wins, as in verl, whose keys these usually interpolate); a key neither knows is an
    unknown-key error."""
    for parts, value in list(_leaves(data)):
        try:
            type_at(root, parts)
            continue
        except KeyError as exc:
            depth = exc.args[0]
        targets = foreign.translate(parts, value, source)
        if targets is None:
            raise unknown_key_error(root, source, parts, depth, foreign)
        parent = _find(data, parts[:-1])
        parent.pop(parts[-1])
        for i in range(len(parts) - 1, 0, -1):  # drop the tables it leaves empty
            table = _find(data, parts[:i])
            if table:
                break
            _find(data, parts[:i - 1]).pop(parts[i - 1])
        for target, target_value in targets:
            if _find(data, target) is None:
                _set_path(data, target, target_value, format_key(target))


def load(root: type[T], path: str | Path, overrides: Iterable[str] = (),
         path_keys: Iterable[tuple[str, ...]] = (),
         file_or_module_keys: Iterable[tuple[str, ...]] = (),
         function_keys: Iterable[tuple[str, ...]] = (),
         aliases: Mapping[KeyPath, KeyPath] | None = None,
         foreign: ForeignKeys | None = None,
         hub_id_keys: Iterable[tuple[str, ...]] = (),
         command_line_keys: set[KeyPath] | None = None) -> T:
    """Read ``path``, check its keys, apply overrides, resolve paths, decode into ``root``.

    ``path_keys`` name the string (or list-of-string) keys that hold file paths: relative
    values from the file are resolved against the file's folder, relative values from the
    command line against the working directory. ``hub_id_keys``, among them, may instead
    hold a Hugging Face Hub ID (``relay.configs.hub``): a value that looks like one and is
    no existing path is kept as written. ``file_or_module_keys`` hold either a Python
    module name (left alone) or a file path (``*.py`` or containing ``/``, resolved).
    ``function_keys`` may hold a function by path, ``module:function`` (left alone) or
    ``path/to/file.py:function`` (its file resolved); any other value is left alone.
    ``aliases`` and ``foreign``: another project's names (module docstring).
    ``command_line_keys`` receives the key paths the overrides set, for the caller's later
    checks to name the command line as their source (``blame_command_line``).
    """
    path = Path(path)
    data = read_toml(path)
    move_aliases(data, aliases or {}, str(path))
    if foreign is not None:
        translate_foreign(root, data, str(path), foreign)
    check_unknown_keys(root, data, str(path))
    touched = apply_overrides(root, data, overrides, aliases, foreign)

    def source_of(parts: Sequence[str | int]) -> str:
        return COMMAND_LINE if any(tuple(parts[: len(t)]) == t for t in touched) else str(path)

    if command_line_keys is not None:
        command_line_keys.update(touched)
    hub_ids = set(hub_id_keys)
    for key in path_keys:
        base = Path.cwd() if key in touched else path.parent.resolve()
        keep = (lambda v, b=base: looks_like_hub_id(v) and not (b / v).exists()) \
            if key in hub_ids else (lambda v: False)
        _resolve_paths(data, key, base=base, only_if=lambda v, k=keep: not k(v))
    for key in file_or_module_keys:
        _resolve_paths(data, key, base=Path.cwd() if key in touched else path.parent.resolve(),
                       only_if=lambda v: v.endswith(".py") or "/" in v)
    for key in function_keys:
        _resolve_function_path(data, key, Path.cwd() if key in touched
                               else path.parent.resolve())
    try:
        return msgspec.convert(data, type=root)
    except msgspec.ValidationError as exc:
        raise explain_validation_error(root, data, exc, source_of) from None


def blame_command_line(error: ConfigError, source: str,
                       command_line_keys: Iterable[KeyPath]) -> ConfigError:
    """``error``, reported against the file ``source``, as the command line's when its key
    (or a section above it) was set there: a check after loading knows only the file."""
    if error.source != source or not error.key:
        return error
    try:
        parts = parse_key(error.key)
    except ValueError:  # several keys in one ("a, b"): the file's
        return error
    if not any(tuple(parts[:len(key)]) == tuple(key) for key in command_line_keys):
        return error
    blamed = ConfigError(COMMAND_LINE, error.key, error.problem)
    blamed.__cause__ = error.__cause__
    return blamed


def _resolve_function_path(data: dict[str, Any], key: tuple[str, ...], base: Path) -> None:
    node: Any = data
    for part in key[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    value = node.get(key[-1]) if isinstance(node, dict) else None
    if isinstance(value, str) and is_spec(value):
        location, _, name = value.rpartition(":")
        if is_file(location):
            node[key[-1]] = f"{(base / Path(location).expanduser()).resolve()}:{name}"


def _resolve_paths(data: dict[str, Any], key: tuple[str, ...], base: Path,
                   only_if: Callable[[str], bool] = lambda v: True) -> None:
    node: Any = data
    for part in key[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or key[-1] not in node:
        return
    value = node[key[-1]]

    def resolve(v: Any) -> Any:
        if not isinstance(v, str) or not v or ":" in v.split("/")[0] or not only_if(v):
            return v  # empty, "builtin:...", a URI or a module name: not a local path
        return str((base / Path(v).expanduser()).resolve())

    node[key[-1]] = [resolve(v) for v in value] if isinstance(value, list) else resolve(value)
