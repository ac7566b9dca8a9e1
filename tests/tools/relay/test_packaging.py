"""What the wheel ships runs on every Python that ``requires-python`` allows, and imports only
packages that pyproject.toml declares (issue 31, item 1).

- Every third-party package a shipped module imports is in ``[project] dependencies``
  (mapped from import name to distribution by ``importlib.metadata``), except the optional
  engines, trackers and kernels (``OPTIONAL``), which may only be imported lazily, inside a
  function, where a missing one fails the feature that asked for it and nothing else. A
  module that is one optional package's feature (``FEATURE_MODULES``) imports it at the top
  and is itself imported only lazily.
- Every shipped module compiles under each Python 3.10-3.13 interpreter found on this
  machine (pyenv's, or on ``PATH``); and ``vermin``, where installed, finds no feature newer
  than the oldest Python allowed.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SHIPPED = sorted(ROOT / folder
                 for folder in PROJECT["tool"]["setuptools"]["package-dir"].values())
OPTIONAL = {"vllm", "sglang", "flash_attn", "deepspeed", "wandb", "swanlab", "tensorboard",
            "trl", "datasets", "ray", "peft"}
"""Import names of the optional packages (extras, or installed by the user for a feature)."""
FEATURE_MODULES = {"relay.learner.lora": "peft"}
"""Modules built on one optional package: they import it at the top, and every other module
imports them lazily."""
MIN_PYTHON = re.fullmatch(r">=\s*3\.(\d+)", PROJECT["project"]["requires-python"])
PYTHONS = [f"3.{minor}" for minor in range(10, 14)]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions ``[project] dependencies`` names (whatever their markers)."""
    return {normalized(re.match(r"[A-Za-z0-9._-]+", spec)[0])
            for spec in PROJECT["project"]["dependencies"]}


def imports(path: Path) -> Iterator[tuple[str, int, bool]]:
    """``(module, line, lazy)`` of each absolute import in ``path`` (``import a.b``: "a.b";
    ``from a.b import c``: "a.b"); ``lazy``: inside a function."""
    def walk(node: ast.AST, lazy: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield from ((alias.name, child.lineno, lazy) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module, child.lineno, lazy
            yield from walk(child, lazy or isinstance(child, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef)))
    yield from walk(ast.parse(path.read_text(), str(path)), False)


def shipped_modules() -> list[Path]:
    return sorted(p for folder in SHIPPED for p in folder.rglob("*.py")
                  if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """The dotted name a shipped file installs as (pyproject's ``package-dir``)."""
    folders = PROJECT["tool"]["setuptools"]["package-dir"]
    package, folder = max(((package, ROOT / folder) for package, folder in folders.items()
                           if path.is_relative_to(ROOT / folder)),
                          key=lambda entry: len(entry[1].parts))
    parts = path.relative_to(folder).with_suffix("").parts
    return ".".join((package, *parts)).removesuffix(".__init__")


def third_party(name: str) -> bool:
    return name not in sys.stdlib_module_names and name not in ("relay", "__future__")


def test_every_imported_package_is_declared_or_an_optional_lazy_import() -> None:
    distributions = packages_distributions()
    wanted = declared()
    problems = []
    for path in shipped_modules():
        where = path.relative_to(ROOT)
        feature = FEATURE_MODULES.get(module_name(path))
        for module, line, lazy in imports(path):
            name = module.split(".")[0]
            if module in FEATURE_MODULES and not lazy:
                problems.append(f"{where}:{line}: {module} (needs "
                                f"{FEATURE_MODULES[module]}) imported at module level")
            if not third_party(name) or name == feature:
                continue
            dists = {normalized(d) for d in distributions.get(name, [name])}
            if name == "torch" or dists & wanted:  # torch.utils.tensorboard: OPTIONAL's, lazily
                continue
            if name in OPTIONAL and not lazy:
                problems.append(f"{where}:{line}: optional {name} imported at module level")
            elif name not in OPTIONAL:
                problems.append(f"{where}:{line}: {name} ({', '.join(sorted(dists))}) is "
                                "not in pyproject.toml's dependencies")
    assert not problems, "\n".join(problems)


def test_feature_modules_are_named_as_installed() -> None:
    """The names ``FEATURE_MODULES`` exempts are the files' (a wrong one exempts nothing)."""
    assert module_name(ROOT / "learner" / "lora.py") == "relay.learner.lora"
    assert module_name(ROOT / "tools" / "relay" / "cli.py") == "relay.cli"
    names = {module_name(path) for path in shipped_modules()}
    assert FEATURE_MODULES.keys() <= names


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import pandas\n\ndef f():\n    import wandb\n")
    assert list(imports(module)) == [("pandas", 1, False), ("wandb", 4, True)]
    assert normalized("pandas") not in declared()


def interpreter(version: str) -> str | None:
    """A ``python3.N`` on this machine: pyenv's, else one on ``PATH`` that is not a shim."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for found in sorted(pyenv.glob(f"{version}.*/bin/python{version}"), reverse=True):
        return str(found)
    on_path = shutil.which(f"python{version}")
    return on_path if on_path and "shims" not in on_path else None


COMPILE_ALL = """
import sys, warnings
warnings.simplefilter("error")
bad = []
for path in sys.argv[1:]:
    try:
        compile(open(path, encoding="utf-8").read(), path, "exec")
    except (SyntaxError, SyntaxWarning) as exc:
        bad.append(f"{path}: {exc!r}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("version", PYTHONS)
def test_every_shipped_module_compiles_under(version: str) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    done = subprocess.run([python, "-c", COMPILE_ALL, *map(str, shipped_modules())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_vermin_finds_nothing_newer_than_requires_python() -> None:
    """vermin (``pip install vermin``): the standard library's modules, members and syntax
    by the Python version that added them (``hashlib.file_digest``: 3.11, ``tomllib``:
    3.11 unless behind an ``ImportError`` fallback, ...)."""
    pytest.importorskip("vermin")
    assert MIN_PYTHON, PROJECT["project"]["requires-python"]
    command = "import sys, vermin; sys.argv[0] = 'vermin'; sys.exit(vermin.main())"
    done = subprocess.run([sys.executable, "-c", command, "--no-tips", "--violations",
                           "--eval-annotations",
                           f"--target=3.{MIN_PYTHON[1]}-", *map(str, SHIPPED)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
