"""Roles: which part a client plays towards a server, and how a server knows it.

Relay's clients of the buffer play one of two roles: the ``learner`` (batches, versions,
the end of the run, checkpoints) or a ``generator`` (attach, heartbeats, leases, rollouts).
The server lists which role may send each message (``buffer.hub.SENDERS``); ``PeerRoles``
decides whether a peer holds that role.

A connection takes its role with the first message it sends (a ZeroMQ server sees each
connection under an identity of its own) and keeps it: a connection that acted as a
generator is refused learner messages and the other way round; a process that plays both
opens a connection for each. Under CURVE the key a peer authenticated with, named after its
file in the server's authorized-clients folder (``transport.security``), bounds the roles it
may take:

- ``learner*.key``: learner, or generator (the learner's hosts hold the server's secret key
  anyway, and a one-machine run's generators share the learner's key folder);
- ``generator*.key``: generator only, so a generator host cannot act as the learner;
- any other name (a keys folder made before per-role keys, such as ``client.key``): every
  role, with a warning the first time the name is seen.

Without CURVE (loopback only) every connection may take either role: the binding keeps a
confused peer in its lane but does not stop a hostile process on the same machine, which
CURVE does.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Literal, get_args

from transport.sockets import Peer

logger = logging.getLogger(__name__)

Role = Literal["learner", "generator"]
ROLES: frozenset[Role] = frozenset(get_args(Role))
KEY_ROLES: dict[str, frozenset[Role]] = {
    "learner": ROLES,
    "generator": frozenset({"generator"}),
}
"""The roles a CURVE key may take, by the start of its name."""
MAX_CONNECTIONS = 65_536  # bindings remembered; the longest unused is forgotten first


def key_roles(key: str) -> frozenset[Role] | None:
    """The roles a key of this name may take, or None for a name that says no role."""
    return next((roles for prefix, roles in KEY_ROLES.items() if key.startswith(prefix)), None)


class PeerRoles:
    """The role each connection took, bounded by its CURVE key (module docstring)."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS) -> None:
        self.max_connections = max_connections
        self._bound: OrderedDict[bytes, Role] = OrderedDict()
        self._warned: set[str] = set()

    def admit(self, peer: Peer, role: Role) -> str:
        """"" when ``peer`` may send a message of ``role`` (its connection takes that role
        if it had none), else why not."""
        bound = self._bound.get(peer.identity)
        if bound is not None:
            self._bound.move_to_end(peer.identity)
            if bound == role:
                return ""
            return (f"this connection acts as the {bound}; it cannot send {role} messages "
                    "(a connection keeps the role of its first message)")
        allowed = self._allowed(peer.key)
        if role not in allowed:
            return (f"CURVE key {peer.key!r} may act as {' or '.join(sorted(allowed))}, "
                    f"not as the {role}")
        self._bound[peer.identity] = role
        if len(self._bound) > self.max_connections:
            self._bound.popitem(last=False)
        return ""

    def _allowed(self, key: str) -> frozenset[Role]:
        if not key:
            return ROLES  # no CURVE: loopback only
        roles = key_roles(key)
        if roles is not None:
            return roles
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("CURVE key %r names no role, so it may act as the learner and as a "
                           "generator; make per-role keys with tools/make-curve-keys.py "
                           "(learner.key, generator.key)", key)
        return ROLES
