"""CURVE authentication and the rule that a reachable bind needs it.

This module knows ZeroMQ CURVE: key pairs on disk (``zmq.auth`` certificate files), the
server side (a private context whose ZAP authenticator accepts only the public keys found
in an authorized-clients directory) and the client side (its key pair plus the server's
public key). It also holds the one check every bind goes through: a bind reachable from
other machines without CURVE keys raises ``InsecureBindError``.

The server's ZAP handler names every client it lets in after its public key's file in the
authorized-clients directory (``authorized/generator.key`` -> ``"generator"``) and ZeroMQ
hands that name, the ZAP User-Id, to the server with each message (``Peer.key`` in
``relay.transport.sockets``), so a server can tell what a client may do by the key it holds
(``relay.transport.roles``). This module does not know which process holds which key (the
topology config and ``tools/make-curve-keys.py`` do) nor anything about messages. Key
files: ``<name>.key`` (public, safe to copy to peers) and ``<name>.key_secret`` (secret,
stays on its host). Keys are written private (files 0600 in 0700 folders) and a secret
file that group or others may access is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from relay.transport.endpoints import is_local_endpoint


class InsecureBindError(ValueError):
    """A socket was asked to bind a non-loopback address without CURVE keys."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        super().__init__(
            f"refusing to bind {endpoint} without CURVE keys: it is reachable from other "
            "machines, so anyone there could send messages. Bind a loopback address "
            "(127.0.0.1, ::1, localhost) or ipc://, or pass ServerKeys "
            "(keys made with relay.transport.security.create_keypair)."
        )


class KeyFileError(ValueError):
    """A key file is missing, holds no usable key, or is a secret others may read."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85-encoded (40 bytes each) as ``zmq.auth`` writes them."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class ServerKeys:
    """What a binding socket needs for CURVE: its key pair and whom to let in."""

    keypair: KeyPair
    authorized_clients: Path  # directory of client public key files (*.key)


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting socket needs for CURVE: its key pair and the server's public key."""

    keypair: KeyPair
    server_public_key: bytes


Keys = ServerKeys | ClientKeys


PRIVATE_DIR_MODE = 0o700
OTHERS_BITS = stat.S_IRWXG | stat.S_IRWXO  # any access by the group or by others


def create_keypair(directory: str | os.PathLike[str], name: str) -> KeyPair:
    """Write ``<name>.key`` and ``<name>.key_secret`` under ``directory`` and return the pair.

    Both files are made 0600 under umask 077, in ``directory`` made private first
    (``private_dir``). Files of that name already there are removed first: rewriting one in
    place would keep its old mode, and any reader holding it open would read the new key.
    The umask is the process's, so another thread making files meanwhile makes them 0600
    too (tighter, never looser).
    """
    folder = private_dir(directory)
    with _private_umask():
        for stale in (folder / f"{name}.key", folder / f"{name}.key_secret"):
            stale.unlink(missing_ok=True)
        _public_file, secret_file = zmq.auth.create_certificates(folder, name)
    return load_keypair(secret_file)


def private_dir(directory: str | os.PathLike[str]) -> Path:
    """``directory``, made with its missing parents as 0700 (umask 077), or tightened to 0700
    when it exists and the group or others may access it: a folder of secret keys is private
    whoever made it (this is what makes a keys folder made before these checks safe)."""
    folder = Path(directory)
    with _private_umask():
        folder.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    if folder.stat().st_mode & OTHERS_BITS:
        folder.chmod(PRIVATE_DIR_MODE)
    return folder


@contextmanager
def _private_umask() -> Iterator[None]:
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def load_keypair(secret_file: str | os.PathLike[str]) -> KeyPair:
    """Read a key pair from a ``.key_secret`` file written by ``create_keypair``; a file
    that the group or others may read or write is refused (``check_private``)."""
    check_private(secret_file)
    public, secret = _load(secret_file)
    if secret is None:
        raise KeyFileError(
            f"{secret_file} holds no secret key; pass the .key_secret file, not the .key file"
        )
    return KeyPair(public=public, secret=secret)


def load_public_key(key_file: str | os.PathLike[str]) -> bytes:
    """Read the public key from a ``.key`` (or ``.key_secret``) file."""
    public, _secret = _load(key_file)
    return public


def check_private(secret_file: str | os.PathLike[str]) -> None:
    """Raise ``KeyFileError`` naming the fix when ``secret_file`` exists and its mode gives
    the group or others any access (as ssh does for a private key; a missing file is left
    to the loader, which names it)."""
    try:
        mode = os.stat(secret_file).st_mode
    except FileNotFoundError:
        return
    if mode & OTHERS_BITS:
        who = " and ".join(w for w, bits in (("its group", stat.S_IRWXG), ("others", stat.S_IRWXO))
                           if mode & bits)
        raise KeyFileError(
            f"secret key file {secret_file} has mode {stat.S_IMODE(mode):04o}: {who} may read "
            f"or change it, so the key may be known outside this account. Run "
            f"`chmod 600 {secret_file}` (and make a new key pair if someone else could read it)"
        )


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise KeyFileError(f"key file {path} does not exist (create it with create_keypair)")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise KeyFileError(f"key file {path} is not a zmq certificate: {exc}") from exc


def authorized_key_names(directory: str | os.PathLike[str]) -> dict[bytes, str]:
    """Each authorized client's public key (Z85) -> its file's name without ``.key``, for
    every ``*.key`` in ``directory`` (in name order; a key found twice keeps its first name)."""
    names: dict[bytes, str] = {}
    for key_file in sorted(Path(directory).glob("*.key")):
        names.setdefault(load_public_key(key_file), key_file.stem)
    return names


class _NamingAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, with each admitted client's User-Id the name of its key file."""

    def __init__(self, context: zmq.Context, names: dict[bytes, str]) -> None:
        super().__init__(context)
        self.names = names

    def curve_user_id(self, client_public_key: bytes) -> str:
        public = z85.encode(client_public_key)
        return self.names.get(public, public.decode("ascii"))


def check_bind(endpoint: str, keys: Keys | None) -> None:
    """Raise ``InsecureBindError`` unless ``endpoint`` is local or ``keys`` are server keys."""
    if keys is not None and not isinstance(keys, ServerKeys):
        raise TypeError(
            f"binding {endpoint} needs ServerKeys (own key pair + authorized clients), "
            f"got {type(keys).__name__}"
        )
    if keys is None and not is_local_endpoint(endpoint):
        raise InsecureBindError(endpoint)


class CurveAuthenticator:
    """A private ZeroMQ context whose ZAP handler admits only the authorized client keys.

    ZAP is per context, so each CURVE server owns one context and authenticator; sockets
    made from ``context`` and passed to ``secure`` accept only clients whose public key
    file is in ``keys.authorized_clients`` when the authenticator started (a snapshot), and
    receive each message with its sender's key name as ZeroMQ's ``User-Id`` property.
    """

    def __init__(self, keys: ServerKeys) -> None:
        authorized = Path(keys.authorized_clients)
        if not authorized.is_dir():
            raise KeyFileError(
                f"authorized clients directory {authorized} does not exist; "
                "put the clients' public .key files there"
            )
        self.keys = keys
        self.context = zmq.Context()
        self._authenticator = _NamingAuthenticator(self.context,
                                                   authorized_key_names(authorized))
        try:
            self._authenticator.start()
            self._authenticator.configure_curve(domain="*", location=str(authorized))
        except BaseException:
            self.close()
            raise

    def secure(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (made from ``self.context``) a CURVE server; call before bind."""
        socket.curve_server = True
        socket.curve_publickey = self.keys.keypair.public
        socket.curve_secretkey = self.keys.keypair.secret

    def close(self) -> None:
        """Stop the authenticator and end the context (its sockets must be closed first)."""
        if self._authenticator.is_alive():
            self._authenticator.stop()
        self.context.term()


def secure_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``socket`` a CURVE client of the server holding ``keys.server_public_key``."""
    socket.curve_serverkey = keys.server_public_key
    socket.curve_publickey = keys.keypair.public
    socket.curve_secretkey = keys.keypair.secret
