"""relay.cli: ``relay COMMAND ARGS`` runs ``COMMAND``'s module's ``main(ARGS)``; help, version
and a mistyped command are answered without importing any command."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from relay import __version__, cli


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)


def test_no_command_prints_the_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: relay COMMAND" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"relay {__version__}"


def test_a_mistyped_command_is_refused_with_a_suggestion(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lanch", "--dry-run"]) == 2
    assert "unknown command 'lanch' (did you mean `relay launch`?)" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_is_a_module_with_a_main(name: str) -> None:
    assert callable(importlib.import_module(cli.COMMANDS[name][0]).main)


def test_a_command_gets_its_arguments_and_its_name(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["relay"])
    with pytest.raises(SystemExit) as exit_:
        cli.main(["keys", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: relay keys")



def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path) -> None:
    """``relay rollouts RUN --step 4 | head``: the closed pipe is the reader's choice, not an
    error; the command ends with 0 and no traceback."""
    (tmp_path / "long_output.py").write_text(
        "def main(argv):\n    for i in range(200000):\n        print('line', i)\n    return 0\n")
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from relay import cli; "
              "cli.COMMANDS['long'] = ('long_output', ''); sys.exit(cli.main(['long']))")
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL)
    writer = subprocess.run([sys.executable, "-c", script], stdout=reader.stdin,
                            stderr=subprocess.PIPE, text=True, timeout=120)
    reader.stdin.close()
    reader.wait(timeout=60)
    assert writer.returncode == 0 and "Traceback" not in writer.stderr, writer.stderr
