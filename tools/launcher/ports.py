"""Free ports for a run's port-0 settings, picked where the processes will bind them."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import msgspec

from relay.configs.topology_schema import Topology

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 20000


def free_port(rng: random.Random | None = None) -> int:
    """A loopback port nothing listens on now, below the kernel's ephemeral range.

    A port the kernel handed out for ``bind(0)`` is free only until it hands it out again,
    to any process's next outgoing connection or ``bind(0)``, before our process binds it
    (the trackers' background services open sockets while a run starts). A port below the
    ephemeral range is never handed out that way; it is taken only by an explicit bind."""
    rng = rng or random.Random()
    try:
        ephemeral_low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default range starts here
    for _ in range(100):
        port = rng.randrange(LOWEST_PICKED_PORT, max(ephemeral_low, LOWEST_PICKED_PORT + 1))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try was taken: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assign_ports(topology: Topology) -> Topology:
    """Replace every port 0 with a free port of this machine."""
    replace = msgspec.structs.replace
    buffer = topology.buffer if topology.buffer.port else replace(topology.buffer,
                                                                  port=free_port())
    learner = topology.learner
    if not learner.weights_port:
        learner = replace(learner, weights_port=free_port())
    if not learner.weights_stream_port:
        learner = replace(learner, weights_stream_port=free_port())
    if not learner.master_port:
        learner = replace(learner, master_port=free_port())
    launcher = topology.launcher if topology.launcher.metrics_port else replace(
        topology.launcher, metrics_port=free_port())
    reward_models = [r if r.port else replace(r, port=free_port())
                     for r in topology.reward_models]
    return replace(topology, buffer=buffer, learner=learner, launcher=launcher,
                   reward_models=reward_models)
