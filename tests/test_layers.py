"""DESIGN's layering: layers import downward only,

    tools -> {learner, generators} -> buffer -> configs -> {algorithms, transport}

checked on every import statement of every shipped module (the folders of pyproject's
``package-dir``), those inside functions included. A module may import its own layer's
packages and those of the layers below it:

    layer       rank  packages (folder)                            may import
    tools         4   relay (tools/relay), relay.launcher          every layer
                      (tools/launcher)
    learner       3   relay.learner (learner)                      buffer, configs,
                                                                   algorithms, transport
    generators    3   relay.generators (generators)                configs, algorithms,
                                                                   transport (not buffer)
    buffer        2   relay.buffer (buffer)                        configs, algorithms,
                                                                   transport
    configs       1   relay.configs (configs)                      algorithms, transport
    algorithms    0   relay.algorithms (algorithms)                none of Relay's
    transport     0   relay.transport (transport)                  none of Relay's

Learner and generators, and algorithms and transport, share a rank and never import each
other. Generators import no ``relay.buffer`` either: what both need (the prompt rows'
schema) lives in ``relay.configs``. Imports by name at run time (``importlib``) are not
statements and are not checked.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS: dict[str, str] = tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
"""Each top-level package (``relay.learner``) and its folder (``learner``)."""

LAYER = {"relay": "tools", "relay.launcher": "tools", "relay.learner": "learner",
         "relay.generators": "generators", "relay.buffer": "buffer",
         "relay.configs": "configs", "relay.algorithms": "algorithms",
         "relay.transport": "transport"}
"""The layer of each package of ``PACKAGE_DIRS``."""

RANK = {"tools": 4, "learner": 3, "generators": 3, "buffer": 2, "configs": 1,
        "algorithms": 0, "transport": 0}
"""A layer may import its own packages and those of a lower rank (module docstring)."""

FORBIDDEN = {("generators", "buffer")}
"""Imports of a lower layer that are refused all the same: (importing layer, imported)."""


def may_import(importer: str, imported: str) -> bool:
    """Whether a module of layer ``importer`` may import one of layer ``imported``."""
    if (importer, imported) in FORBIDDEN:
        return False
    return importer == imported or RANK[importer] > RANK[imported]


def package_of(module: str) -> str | None:
    """The package of ``PACKAGE_DIRS`` that holds ``module`` (the longest that is a prefix
    of it); None for a module not Relay's."""
    holders = [package for package in PACKAGE_DIRS
               if module == package or module.startswith(package + ".")]
    return max(holders, key=len) if holders else None


def module_name(path: Path) -> str:
    """``learner/tiny_model/build.py`` -> ``relay.learner.tiny_model.build``."""
    for package, folder in PACKAGE_DIRS.items():
        if path.is_relative_to(ROOT / folder):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            return ".".join([package, *parts]).removesuffix(".__init__")
    raise ValueError(f"{path} is in none of pyproject's package-dir folders")


def imported_modules(node: ast.Import | ast.ImportFrom, module: str,
                     is_package: bool) -> list[str]:
    """The modules an import statement of ``module`` names, relative ones resolved; for
    ``from P import N``, ``P.N`` (N may be a submodule: ``from relay import learner``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = module.split(".")[:len(module.split(".")) - node.level + is_package]
        base = ".".join(parent + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def upward_imports(path: Path) -> list[str]:
    """Each import statement of the module at ``path`` that its layer may not make, as
    ``file:line: ...`` naming the import and both layers."""
    module = module_name(path)
    own = LAYER[package_of(module)]
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for imported in imported_modules(node, module, path.name == "__init__.py"):
            package = package_of(imported)
            if package is not None and not may_import(own, LAYER[package]):
                problems.append((node.lineno, f"{path.relative_to(ROOT)}:{node.lineno}: "
                                 f"{ast.unparse(node)!r}: {own} imports {LAYER[package]}"))
    return [problem for _line, problem in sorted(problems)]


def shipped_modules() -> list[Path]:
    return sorted(path for folder in PACKAGE_DIRS.values()
                  for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts)


def test_every_package_has_a_layer() -> None:
    assert set(LAYER) == set(PACKAGE_DIRS)
    assert set(LAYER.values()) == set(RANK)


def test_layers_import_downward_only() -> None:
    modules = shipped_modules()
    assert len(modules) > 100, "the walk found too few modules: is ROOT right?"
    problems = [problem for path in modules for problem in upward_imports(path)]
    assert not problems, ("imports against DESIGN's layering (tools -> {learner, generators} "
                          "-> buffer -> configs -> {algorithms, transport}):\n"
                          + "\n".join(problems))


def test_generators_import_no_buffer() -> None:
    problems = [problem for path in shipped_modules()
                if module_name(path).startswith("relay.generators")
                for problem in upward_imports(path) if problem.endswith("imports buffer")]
    assert not problems, "\n".join(problems)


def test_a_planted_upward_import_is_named_with_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: an import inside a function, a relative one climbing out of its
    package, learner -> generators and generators -> buffer are each reported; downward
    ones are not."""
    folder = tmp_path / "buffer"
    folder.mkdir()
    (folder / "planted.py").write_text(
        "from relay.configs.run_schema import RunConfig\n"
        "from relay.transport import messages\n"
        "\n"
        "def load():\n"
        "    from relay.learner.tiny_model.tokenizer import build_tokenizer\n"
        "    from .. import generators\n")
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "__init__.py").write_text("from relay import generators\n")
    (tmp_path / "generators").mkdir()
    (tmp_path / "generators" / "loop.py").write_text("import relay.configs\n"
                                                     "import relay.buffer.store\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert upward_imports(folder / "planted.py") == [
        "buffer/planted.py:5: 'from relay.learner.tiny_model.tokenizer import "
        "build_tokenizer': buffer imports learner",
        "buffer/planted.py:6: 'from .. import generators': buffer imports generators"]
    assert upward_imports(tmp_path / "learner" / "__init__.py") == [
        "learner/__init__.py:1: 'from relay import generators': learner imports generators"]
    assert upward_imports(tmp_path / "generators" / "loop.py") == [
        "generators/loop.py:2: 'import relay.buffer.store': generators imports buffer"]
