"""relay.launcher.child: a child runs Relay's module even where the working directory holds a
package of the same name, and takes its arguments as ``-m`` would give them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
