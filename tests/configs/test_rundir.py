"""relay.configs.rundir's addresses: a run without CURVE, all on this machine, talks over ipc files
in its sockets folder, and no loopback port is bound; a run with CURVE or a remote host
talks over tcp as the topology says. (The launcher makes that folder private:
tests/tools/launcher/test_plan.py.)"""

from __future__ import annotations

from pathlib import Path

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY
from relay.configs.checks import load_run_config, load_topology
from relay.configs.rundir import RunContext, uses_ipc
from relay.configs.topology_schema import GeneratorPlacement, Security, Topology


def context(topology: Topology, run_dir: Path) -> RunContext:
    return RunContext(run_dir=run_dir, topology=topology, run=load_run_config(DEFAULT_RUN))


def endpoints(ctx: RunContext) -> list[str]:
    return [ctx.buffer_endpoint, ctx.weights_endpoint, ctx.weights_stream_endpoint,
            ctx.metrics_endpoint]


def test_the_default_topology_talks_over_ipc_files_in_the_run_directory(
        tmp_path: Path) -> None:
    ctx = context(load_topology(DEFAULT_TOPOLOGY), tmp_path)
    assert endpoints(ctx) == [f"ipc://{tmp_path}/sockets/{name}" for name in
                              ("buffer", "weights", "weights-stream", "metrics")]
    assert ctx.sockets_dir == tmp_path / "sockets"


def test_curve_or_a_remote_host_keeps_the_topologys_tcp_ports(tmp_path: Path) -> None:
    curve = Topology(security=Security(curve=True, keys_dir=str(tmp_path)))
    remote = Topology(generators=[GeneratorPlacement(name="g", host="10.0.0.3")],
                      security=Security(curve=True, keys_dir=str(tmp_path)))
    for topology in (curve, remote):
        assert not uses_ipc(topology)
        ctx = context(topology, tmp_path)
        assert ctx.sockets_dir is None
        assert endpoints(ctx) == ["tcp://127.0.0.1:7450", "tcp://127.0.0.1:7451",
                                  "tcp://127.0.0.1:7453", "tcp://127.0.0.1:7452"]
    # never without CURVE, even if relay.configs.checks were skipped: a remote host means tcp
    assert not uses_ipc(Topology(generators=[GeneratorPlacement(name="g", host="10.0.0.3")]))
