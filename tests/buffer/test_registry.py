"""The generator registry: membership by heartbeat, throughput and versions of the attached."""

from relay.buffer.registry import Registry
from relay.transport.messages import Attach, Heartbeat


def test_busy_fraction_and_oldest_version_cover_the_attached_generators() -> None:
    registry = Registry(heartbeat_timeout_s=30.0)
    assert registry.busy_fraction(0.0) == 0.0 and registry.oldest_version() == 0
    registry.attach(Attach(generator_id="a", engine="torch", device="cpu", version=2), now=0.0)
    registry.attach(Attach(generator_id="b", engine="torch", device="cpu", version=5), now=10.0)
    registry.heartbeat(Heartbeat(generator_id="a", version=4, generated_tokens=100,
                                 generation_seconds=15.0), now=20.0)
    registry.heartbeat(Heartbeat(generator_id="b", version=6, generated_tokens=50,
                                 generation_seconds=0.0), now=20.0)
    # attached 20 s + 10 s, busy 15 s
    assert registry.busy_fraction(20.0) == 0.5
    assert registry.oldest_version() == 4
    assert registry.generated_tokens == 150
    registry.forget("a")
    assert registry.oldest_version() == 6 and registry.generated_tokens == 150


def test_a_generator_silent_past_the_timeout_is_named() -> None:
    registry = Registry(heartbeat_timeout_s=30.0)
    registry.attach(Attach(generator_id="a", engine="torch", device="cpu"), now=0.0)
    assert registry.silent(29.0) == [] and registry.silent(31.0) == ["a"]


def test_a_live_name_belongs_to_its_process() -> None:
    registry = Registry(heartbeat_timeout_s=30.0)
    first = Attach(generator_id="a", engine="torch", device="cpu", host="h1", pid=10)
    registry.attach(first, now=0.0)
    other = Attach(generator_id="a", engine="torch", device="cpu", host="h2", pid=10)
    assert registry.holder(other, now=20.0) is registry.generators["a"]
    restarted = Attach(generator_id="a", engine="torch", device="cpu", host="h1", pid=11)
    assert registry.holder(restarted, now=20.0) is registry.generators["a"]  # not yet silent
    assert registry.holder(first, now=20.0) is None  # the same process again
    assert registry.holder(other, now=31.0) is None  # the holder fell silent


def test_a_name_is_free_to_a_process_of_its_live_holders_lineage() -> None:
    registry = Registry(heartbeat_timeout_s=30.0)
    registry.attach(Attach(generator_id="a", engine="torch", device="cpu", host="h1", pid=10,
                           lineage="feed0001"), now=0.0)
    holder = registry.generators["a"]
    assert holder.lineage == "feed0001"

    def started(host: str, pid: int, lineage: str, name: str = "a") -> Attach:
        return Attach(generator_id=name, engine="torch", device="cpu", host=host, pid=pid,
                      lineage=lineage)

    # a restart anywhere (another pid, another host: ssh, a Ray actor on another node)
    for restarted in (started("h1", 11, "feed0001"), started("h2", 10, "feed0001")):
        assert registry.replaced(restarted) is holder
        assert registry.holder(restarted, now=1.0) is None  # not silent, yet free
    for other in (started("h1", 11, "feed0002"), started("h1", 11, "")):
        assert registry.replaced(other) is None
        assert registry.holder(other, now=1.0) is holder
    assert registry.replaced(started("h1", 10, "feed0001")) is None  # itself, again
    assert registry.replaced(started("h1", 11, "feed0001", name="b")) is None  # another name


def test_a_holder_without_lineage_is_never_replaced() -> None:
    registry = Registry(heartbeat_timeout_s=30.0)
    registry.attach(Attach(generator_id="a", engine="torch", device="cpu", host="h1", pid=10),
                    now=0.0)  # attached by hand: no lineage
    for lineage in ("", "feed0001"):
        sender = Attach(generator_id="a", engine="torch", device="cpu", host="h1", pid=11,
                        lineage=lineage)
        assert registry.replaced(sender) is None
        assert registry.holder(sender, now=1.0) is registry.generators["a"]
