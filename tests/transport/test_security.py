"""relay.transport.security: CURVE lets exactly the authorized clients in, and a reachable bind
without keys is refused with an error that names the address."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

import relay.keys
from relay.transport.messages import Ack, Heartbeat, Message
from relay.transport.security import (
    ClientKeys,
    InsecureBindError,
    KeyFileError,
    KeyPair,
    ServerKeys,
    check_bind,
    create_keypair,
    load_keypair,
    load_public_key,
    private_dir,
)
from relay.transport.sockets import (
    Client,
    PeerTimeout,
    Puller,
    Pusher,
    Server,
    ServerThread,
)

REFUSED_S = 0.5  # how long a refused client waits before PeerTimeout


def echo(msg: Message, peer: bytes) -> Message:
    """Answers a heartbeat with its version, so each reply shows which request it answers."""
    return Ack(detail=str(msg.version)) if isinstance(msg, Heartbeat) else Ack()


class Keyring:
    """Keys of one test: a server, an authorized client, and an outsider."""

    def __init__(self, root: Path) -> None:
        self.server = create_keypair(root / "server", "server")
        self.client = create_keypair(root / "client", "client")
        self.outsider = create_keypair(root / "outsider", "outsider")
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        shutil.copy(root / "client" / "client.key", self.authorized)

    def server_keys(self) -> ServerKeys:
        return ServerKeys(keypair=self.server, authorized_clients=self.authorized)

    def client_keys(self, keypair: KeyPair, server_public: bytes | None = None) -> ClientKeys:
        return ClientKeys(keypair=keypair, server_public_key=server_public or self.server.public)


@pytest.fixture
def keys(tmp_path: Path) -> Keyring:
    return Keyring(tmp_path)


@pytest.fixture
def curve_server(keys: Keyring) -> Any:
    server = Server("tcp://127.0.0.1:*", echo, keys=keys.server_keys())
    with ServerThread(server, poll_s=0.01):
        yield server


def ask(client: Client, version: int, timeout_s: float = 5.0) -> int:
    reply = client.request(Heartbeat(generator_id="g", version=version), timeout_s, Ack)
    return int(reply.detail)


def test_authorized_client_is_answered(curve_server: Server, keys: Keyring) -> None:
    client = Client(curve_server.endpoint, keys=keys.client_keys(keys.client))
    try:
        assert ask(client, 7) == 7
    finally:
        client.close()


@pytest.mark.parametrize("who", ["no-keys", "wrong-server-key", "unauthorized-key"])
def test_refused_clients_time_out_and_the_server_keeps_serving(
    curve_server: Server, keys: Keyring, who: str
) -> None:
    client_keys = {
        "no-keys": None,
        "wrong-server-key": keys.client_keys(keys.client, server_public=keys.outsider.public),
        "unauthorized-key": keys.client_keys(keys.outsider),
    }[who]
    intruder = Client(curve_server.endpoint, keys=client_keys)
    good = Client(curve_server.endpoint, keys=keys.client_keys(keys.client))
    try:
        with pytest.raises(PeerTimeout) as info:
            ask(intruder, 1, timeout_s=REFUSED_S)
        assert info.value.endpoint == curve_server.endpoint
        assert ask(good, 2) == 2
        assert curve_server.served == 1  # the intruder's request never reached the handler
    finally:
        intruder.close()
        good.close()


def test_curve_push_pull(keys: Keyring) -> None:
    puller = Puller("tcp://127.0.0.1:*", keys=keys.server_keys())
    pusher = Pusher(puller.endpoint, keys=keys.client_keys(keys.client))
    try:
        assert pusher.send(Ack(detail="metrics"))
        assert puller.receive(5.0) == Ack(detail="metrics")
    finally:
        for end in (pusher, puller):
            end.close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://[::]:*"])
@pytest.mark.parametrize("role", ["server", "pusher", "puller"])
def test_reachable_bind_without_keys_is_refused(endpoint: str, role: str) -> None:
    open_socket = {
        "server": lambda: Server(endpoint, echo),
        "pusher": lambda: Pusher(endpoint, bind=True),
        "puller": lambda: Puller(endpoint),
    }[role]
    with pytest.raises(InsecureBindError) as info:
        open_socket()
    assert info.value.endpoint == endpoint
    assert endpoint in str(info.value) and "ServerKeys" in str(info.value)


def test_reachable_bind_with_keys_serves_authorized_clients(keys: Keyring) -> None:
    server = Server("tcp://0.0.0.0:*", echo, keys=keys.server_keys())
    port = server.endpoint.rsplit(":", 1)[1]
    with ServerThread(server, poll_s=0.01):
        client = Client(f"tcp://127.0.0.1:{port}", keys=keys.client_keys(keys.client))
        try:
            assert ask(client, 9) == 9
        finally:
            client.close()


@pytest.mark.parametrize(
    "endpoint, allowed",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.9.10:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/relay.sock", True),
        ("tcp://10.0.0.5:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://relay-host:5555", False),
        ("tcp://128.0.0.1:5555", False),
    ],
)
def test_check_bind_allows_only_local_endpoints_without_keys(endpoint: str, allowed: bool) -> None:
    if allowed:
        check_bind(endpoint, None)
    else:
        with pytest.raises(InsecureBindError, match=endpoint.replace("[", r"\[")):
            check_bind(endpoint, None)


def test_client_keys_cannot_secure_a_bind(keys: Keyring) -> None:
    with pytest.raises(TypeError, match="ServerKeys"):
        check_bind("tcp://0.0.0.0:5555", keys.client_keys(keys.client))


def test_key_files_round_trip_and_bad_files_are_named(tmp_path: Path) -> None:
    pair = create_keypair(tmp_path, "gen-0")
    assert load_keypair(tmp_path / "gen-0.key_secret") == pair
    assert load_public_key(tmp_path / "gen-0.key") == pair.public
    with pytest.raises(KeyFileError, match="gen-0.key holds no secret"):
        load_keypair(tmp_path / "gen-0.key")
    with pytest.raises(KeyFileError, match="missing.key does not exist"):
        load_public_key(tmp_path / "missing.key")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_written_private_under_any_umask(tmp_path: Path) -> None:
    previous = os.umask(0o022)  # the usual one, under which zmq.auth writes 0644 files
    try:
        create_keypair(tmp_path / "new" / "deeper", "gen-0")
        (tmp_path / "loose").mkdir(mode=0o755)
        create_keypair(tmp_path / "loose", "gen-0")
    finally:
        os.umask(previous)
    for folder in (tmp_path / "new", tmp_path / "new" / "deeper", tmp_path / "loose"):
        assert mode(folder) == 0o700, folder
    for folder in (tmp_path / "new" / "deeper", tmp_path / "loose"):
        assert {p.name: mode(p) for p in folder.iterdir()} == \
            {"gen-0.key": 0o600, "gen-0.key_secret": 0o600}


def test_remaking_a_key_does_not_reuse_a_readable_file(tmp_path: Path) -> None:
    old = create_keypair(tmp_path, "gen-0")
    secret = tmp_path / "gen-0.key_secret"
    secret.chmod(0o644)  # as written before keys were private
    with secret.open("rb") as held:  # another account opened it while it was readable
        new = create_keypair(tmp_path, "gen-0")
        assert new.secret not in held.read()
    assert new != old and mode(secret) == 0o600 and load_keypair(secret) == new


@pytest.mark.parametrize("loose, who", [(0o640, "its group"), (0o604, "others"),
                                        (0o644, "its group and others"), (0o620, "its group")])
def test_a_secret_key_others_may_access_is_refused_naming_the_fix(
        tmp_path: Path, loose: int, who: str) -> None:
    pair = create_keypair(tmp_path, "gen-0")
    secret = tmp_path / "gen-0.key_secret"
    secret.chmod(loose)
    with pytest.raises(KeyFileError) as info:
        load_keypair(secret)
    assert f"{secret} has mode {loose:04o}: {who} may" in str(info.value)
    assert f"`chmod 600 {secret}`" in str(info.value)
    secret.chmod(0o600)  # the fix the error names
    assert load_keypair(secret) == pair
    (tmp_path / "gen-0.key").chmod(0o644)  # a public key may be shared
    assert load_public_key(tmp_path / "gen-0.key") == pair.public


def test_private_dir_tightens_an_existing_folder_and_keeps_its_files(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o755)
    (folder / "note").write_text("kept")
    assert private_dir(folder) == folder
    assert mode(folder) == 0o700 and (folder / "note").read_text() == "kept"


def test_make_curve_keys_writes_private_folders_and_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    previous = os.umask(0o022)
    try:
        assert relay.keys.main([str(keys)]) == 0
    finally:
        os.umask(previous)
    made = [keys, *keys.rglob("*")]
    assert {str(p.relative_to(tmp_path)): mode(p) for p in made} == {
        str(p.relative_to(tmp_path)): 0o700 if p.is_dir() else 0o600 for p in made}
    assert {p.name for p in keys.rglob("*.key_secret")} == {"server.key_secret",
                                                            "client.key_secret"}
    # keys, control/{4 key files, authorized/{3}}, generator/{3}, evaluator/{3}
    assert len(made) == 18

