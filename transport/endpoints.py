"""ZeroMQ endpoint strings: build them, take them apart, tell local from reachable.

This module knows the syntax of ``tcp://host:port`` and ``ipc://path`` endpoints and which
hosts are loopback (127.0.0.0/8, ::1, ``localhost``). It does not resolve host names
(any name other than ``localhost`` counts as reachable from outside) and opens no socket.
"""

from __future__ import annotations

import ipaddress
import os

LOCAL_TRANSPORTS = ("ipc", "inproc")  # reachable only from this machine / this process
IPC_PATH_MAX = 107
"""The longest path of an ``ipc://`` socket: Linux's ``sockaddr_un.sun_path`` holds 108
bytes with the terminating NUL (ZeroMQ refuses a longer one at bind and connect)."""


def tcp_endpoint(host: str, port: int | str = "*") -> str:
    """``tcp://host:port``; IPv6 literals get brackets, ``port="*"`` asks for an ephemeral port."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def ipc_endpoint(path: str | os.PathLike[str]) -> str:
    """``ipc://path`` for a Unix domain socket at ``path``."""
    return f"ipc://{os.fspath(path)}"


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """``(transport, address)``: ``"tcp://1.2.3.4:5"`` -> ``("tcp", "1.2.3.4:5")``."""
    transport, sep, address = endpoint.partition("://")
    if not sep or not transport or not address:
        raise ValueError(f"endpoint {endpoint!r} is not of the form transport://address")
    return transport, address


def tcp_host(endpoint: str) -> str:
    """The host part of a tcp endpoint, brackets removed: ``"tcp://[::1]:5"`` -> ``"::1"``."""
    transport, address = split_endpoint(endpoint)
    if transport != "tcp":
        raise ValueError(f"endpoint {endpoint!r} is not a tcp:// endpoint")
    host, sep, _port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint {endpoint!r} has no host:port")
    return host.removeprefix("[").removesuffix("]")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1, ::ffff:127.x.x.x).

    Wildcards (``*``, ``0.0.0.0``), interface names and other host names are not loopback.
    """
    host = host.removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def is_local_endpoint(endpoint: str) -> bool:
    """True when only this machine can reach ``endpoint``: ipc/inproc, or tcp on loopback."""
    transport, _address = split_endpoint(endpoint)
    if transport in LOCAL_TRANSPORTS:
        return True
    return transport == "tcp" and is_loopback(tcp_host(endpoint))


def needs_ipv6(endpoint: str) -> bool:
    """True for a tcp endpoint whose host is an IPv6 literal (the socket must enable IPv6)."""
    transport, _address = split_endpoint(endpoint)
    return transport == "tcp" and ":" in tcp_host(endpoint)
