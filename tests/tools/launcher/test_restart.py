"""Generators that heal: the supervisor starts a dead generator again, on the local backend.

A fake generator (``python -c``) that exits 1 a moment after it starts is started again
under its name with the same ``--lineage`` token as its first start, after a wait that doubles
from ``RESTART_BACKOFF_S`` up to ``RESTART_BACKOFF_MAX_S``, at most ``max_restarts`` times,
with a note on the status line each time; then it stays dead and training goes on.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from relay.configs import DEFAULT_RUN, load_run_config
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import GeneratorPlacement, Topology
from relay.launcher import supervisor
from relay.launcher.backends import SubprocessBackend
from relay.launcher.plan import ProcessSpec, private_sockets, remove_sockets
from relay.launcher.ports import assign_ports
from relay.launcher.resolve import ResolvedLaunch
from relay.launcher.supervisor import Running, Supervisor, with_lineage

GENERATOR_LIVES_S = 0.2
GENERATOR = f"""\
import os, sys, time
print("started", time.monotonic(), os.getpid(), *sys.argv[1:], flush=True)
time.sleep({GENERATOR_LIVES_S})
sys.exit(1)
"""
LEARNER = """\
import sys, time
log, starts = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        if open(log).read().count("started") >= starts:
            break
    except OSError:
        pass
    time.sleep(0.05)
time.sleep(2.0)  # longer than the next wait would be: no start beyond max_restarts
"""


class FakePlan(SubprocessBackend):
    """The local backend, starting a plan given to it instead of the topology's."""

    def __init__(self, specs: list[ProcessSpec]) -> None:
        super().__init__("local")
        self.specs = specs

    def plan(self, topology: Topology, run: RunConfig, run_dir: Path) -> list[ProcessSpec]:
        return self.specs


def supervised(run_dir: Path, specs: list[ProcessSpec], max_restarts: int) -> Supervisor:
    """A supervisor of ``specs`` on the local backend, with the topology's ``gen0`` allowed
    ``max_restarts`` (its metrics socket in ``run_dir``'s private folder)."""
    topology = private_sockets(assign_ports(Topology(generators=[GeneratorPlacement(
        name="gen0", max_restarts=max_restarts)])), run_dir)
    run = load_run_config(DEFAULT_RUN)
    resolved = ResolvedLaunch(topology_file="", run_file="", topology=topology, run=run,
                              run_dir=run_dir, processes=specs)
    return Supervisor(resolved, topology, run, FakePlan(specs))


def test_a_dead_generator_is_started_again_in_its_lineage_up_to_max_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", 0.2)
    restarts = 3
    gen_log = tmp_path / "logs" / "gen0.log"
    specs = [ProcessSpec(name="learner", role="learner", host="127.0.0.1",
                         argv=[sys.executable, "-c", LEARNER, str(gen_log), str(restarts + 1)]),
             ProcessSpec(name="gen0", role="generator", host="127.0.0.1", essential=False,
                         argv=[sys.executable, "-c", GENERATOR, "--name", "gen0"])]
    sup = supervised(tmp_path, specs, max_restarts=restarts)
    try:
        outcome = sup.execute()
    finally:
        if sup.topology.security.sockets_dir:  # private_sockets made one outside tmp_path
            remove_sockets(Path(sup.topology.security.sockets_dir))
    assert outcome.code == 0, outcome.reason
    assert "--lineage" not in sup.processes[0].spec.argv  # the learner's: no generator

    starts = [line.split() for line in gen_log.read_text().splitlines()
              if line.startswith("started")]
    assert len(starts) == restarts + 1  # and no more: the learner waited past the next wait
    times = [float(s[1]) for s in starts]
    token = sup.lineages["gen0"]
    assert re.fullmatch(r"[0-9a-f]{32}", token)
    assert starts[0][3:] == ["--name", "gen0", "--lineage", token]
    for before, after in zip(range(restarts), range(1, restarts + 1)):
        # every process of gen0 has one lineage: a restart that dies before it attaches
        # leaves the buffer's holder of the name in the lineage of the next
        assert starts[after][3:] == starts[0][3:]
        assert starts[after][2] != starts[before][2]  # in a new process
        waited = times[after] - times[before] - GENERATOR_LIVES_S
        assert waited >= 0.2 * 2 ** before  # 0.2 s, 0.4 s, 0.8 s: doubling

    notes = capsys.readouterr().out
    for restart in range(1, restarts + 1):
        assert re.search(rf"generator gen0 died \(exit code 1\); starting it again in [\d.]+ s "
                         rf"\(restart {restart} of {restarts}\); training goes on", notes)
        assert f"generator gen0 started again (restart {restart})" in notes
    assert "generator gen0 died (exit code 1); no restarts left; training goes on without " \
           "it" in notes
    assert notes.count("generator gen0 died") == restarts + 1


class Ended:
    """A process handle whose process exited 1."""

    pid = 4242

    def poll(self) -> int:
        return 1


def dead_generator(tmp_path: Path, restarts: int) -> Running:
    spec = ProcessSpec(name="gen0", role="generator", host="127.0.0.1", essential=False,
                       argv=["generator"])
    return Running(spec=spec, process=Ended(), log=tmp_path / "gen0.log",  # type: ignore[arg-type]
                   restarts=restarts)


@pytest.mark.parametrize("max_restarts", [0, 4])
def test_the_wait_doubles_up_to_its_cap_and_stops_at_max_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_restarts: int) -> None:
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", 1.0)
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_MAX_S", 5.0)
    sup = supervised(tmp_path, [], max_restarts=max_restarts)
    due = []
    for restarts in range(max_restarts + 1):
        sup._generator_died(dead_generator(tmp_path, restarts), 1, now=100.0)
        due.append(sup.restart_due.pop("gen0", None))
    assert due == [100.0 + wait for wait in (1.0, 2.0, 4.0, 5.0)][:max_restarts] + [None]


def test_the_lineage_is_named_once_last() -> None:
    argv = ["python", "-c", "boot", "relay.generators.main", "--name", "gen0"]
    once = with_lineage(argv, "feed0001")
    assert once == [*argv, "--lineage", "feed0001"]
    assert with_lineage(once, "feed0001") == once
    assert with_lineage(once, "feed0002") == [*argv, "--lineage", "feed0002"]


def test_a_generators_token_is_drawn_anew_per_launch(
        tmp_path: Path) -> None:
    first, second = supervised(tmp_path, [], 1), supervised(tmp_path, [], 1)
    assert first.lineages.keys() == {"gen0"}
    assert first.lineages["gen0"] != second.lineages["gen0"]
