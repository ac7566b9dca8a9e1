"""The command line that runs one of Relay's modules in a child process, immune to the
working directory.

``python -m pkg.mod`` puts the working directory first on ``sys.path``, so a user's project
with its own ``relay/`` (or ``torch/``) folder would be imported instead of the installed
package. ``-P`` (Python 3.11+) removes it but Python 3.10 has no such flag, and ``-I`` also
drops ``PYTHONPATH`` and the user's site-packages. So a child runs ``python -c BOOT MODULE
ARGS...``: ``BOOT`` removes the ``''`` entry that ``-c`` puts first, then runs ``MODULE`` as
``__main__`` with ``ARGS`` as its ``sys.argv[1:]``, exactly as ``-m`` would.
"""

from __future__ import annotations

BOOT = ('import sys; sys.path[:1] = filter(None, sys.path[:1]); import runpy; '
        'runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)')
# sys.path is fixed before ``runpy`` is imported: not loaded at start-up under ``-c`` (and not
# frozen before Python 3.11), a ``runpy.py`` in the working directory would stand in for it.


def module_argv(python: str, module: str, *args: str) -> list[str]:
    """``python -m module args`` without the working directory on ``sys.path``."""
    return [python, "-c", BOOT, module, *args]
