"""Roles: which part a client plays towards a server, and how a server knows it.

Relay's clients play one of four roles: the ``learner`` (batches, versions, the end of the
run, checkpoints; its step on the metrics address), a ``generator`` (attach, heartbeats,
leases, rollouts), the ``evaluator`` (asks the learner's weight server for weights to
evaluate and hands in its reports) and the ``buffer`` (its gauges on the metrics address).
Each server lists which role may send each message (``relay.buffer.hub.SENDERS``, the weight
server's ``EvalRequest``, the launcher's metrics by ``Metrics.source``); ``PeerRoles``
decides whether a peer holds that role.

A connection takes its role with the first message it sends (a ZeroMQ server sees each
connection under an identity of its own) and keeps it: a connection that acted as a
generator is refused learner messages and the other way round; a process that plays both
opens a connection for each. A PULL socket (the metrics address) sees no connections, only
each message's key (``may_act_as``). Under CURVE the key a peer authenticated with, named
after its file in the server's authorized-clients folder (``relay.transport.security``), bounds
the roles it may take:

- ``learner*.key``: every role. It is the control hosts' key (buffer, learner, launcher:
  they hold the server's secret key anyway), which the buffer's metrics use, and a
  one-machine run's generators and evaluator share the control key folder;
- ``generator*.key``: generator only, so a generator host can neither act as the learner
  nor steer evaluation or the launcher's watchdog;
- ``evaluator*.key``: evaluator only;
- any other name (a keys folder made before per-role keys, such as ``client.key``): every
  role, with a warning the first time the name is seen.

Without CURVE every connection may take any role (the first binds it): the binding keeps a
confused peer in its lane but does not stop a hostile process that can reach the socket,
which CURVE does. The default topology's sockets are ``ipc://`` files in a folder only the
run's user may open (``relay.configs.rundir``), so that process is the user's own.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Literal, get_args

from relay.transport.sockets import Peer

logger = logging.getLogger(__name__)

Role = Literal["learner", "generator", "evaluator", "buffer"]
ROLES: frozenset[Role] = frozenset(get_args(Role))
KEY_ROLES: dict[str, frozenset[Role]] = {
    "learner": ROLES,
    "generator": frozenset({"generator"}),
    "evaluator": frozenset({"evaluator"}),
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
        refusal = self.may_act_as(peer.key, role)
        if refusal:
            return refusal
        self._bound[peer.identity] = role
        if len(self._bound) > self.max_connections:
            self._bound.popitem(last=False)
        return ""

    def may_act_as(self, key: str, role: str) -> str:
        """"" when a peer holding the CURVE key named ``key`` ("" without CURVE) may act as
        ``role``, else why not (the role of a message on a socket that sees no connections,
        such as the ``source`` of ``Metrics``)."""
        allowed = self._allowed(key)
        if role in allowed:
            return ""
        return (f"CURVE key {key!r} may act as {' or '.join(sorted(allowed))}, not as the "
                f"{role}")

    def _allowed(self, key: str) -> frozenset[Role]:
        if not key:
            return ROLES  # no CURVE: a socket only this machine reaches (module docstring)
        roles = key_roles(key)
        if roles is not None:
            return roles
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("CURVE key %r names no role, so it may act in every role (learner, "
                           "generator, evaluator); make per-role keys with "
                           "tools/make-curve-keys.py (learner.key, generator.key, "
                           "evaluator.key)", key)
        return ROLES
