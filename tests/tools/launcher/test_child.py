"""relay.launcher.child: a child runs Relay's module even where the working directory holds a
package of the same name, and takes its arguments as ``-m`` would give them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay.launcher.child import module_argv


def test_a_users_own_relay_package_in_the_working_directory_is_not_imported(tmp_path: Path):
    shadow = tmp_path / "relay" / "launcher"
    shadow.mkdir(parents=True)
    (tmp_path / "relay" / "__init__.py").write_text("raise SystemExit('the user relay ran')\n")
    (shadow / "__init__.py").write_text("")
    plain = subprocess.run([sys.executable, "-m", "relay.launcher.child"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert "the user relay ran" in plain.stderr  # what -m does: the working directory wins
    done = subprocess.run(module_argv(sys.executable, "relay.launcher.child"), cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_module_gets_its_arguments_as_under_dash_m(tmp_path: Path):
    script = ("import sys, relay; assert 'site-packages' in relay.__file__ or "
              "'tools' in relay.__file__; print(sys.argv[1:])")
    module = tmp_path / "lib" / "argv_probe.py"
    module.parent.mkdir()
    module.write_text(script)
    env = {"PYTHONPATH": str(module.parent), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(module_argv(sys.executable, "argv_probe", "--run-dir", "a b", "-c"),
                          cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['--run-dir', 'a b', '-c']"


def python_310() -> list[str]:
    """Python 3.10 (pyenv's) where this machine has it: its ``runpy`` is not frozen, so it is
    looked up on ``sys.path`` like any module."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    return [str(p) for p in sorted(pyenv.glob("3.10.*/bin/python3.10"))[-1:]]


@pytest.mark.parametrize("python", [sys.executable, *python_310()])
def test_the_standard_library_the_boot_imports_is_not_shadowed_either(tmp_path: Path,
                                                                       python: str):
    (tmp_path / "runpy.py").write_text("raise SystemExit('the user runpy ran')\n")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("raise SystemExit('the user json ran')\n")
    done = subprocess.run(module_argv(python, "json.tool", "--help"), cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout
