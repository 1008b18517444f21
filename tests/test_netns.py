"""bench/engine/netns.py: rate parsing, and (where root, ip and tc exist) a shaped loopback that
delivers the set rate and disappears afterwards."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.engine import netns


@pytest.mark.parametrize("text, bits", [
    pytest.param("100mbit", 100_000_000, id="100mbit"),
    pytest.param("1gbit", 1_000_000_000, id="1gbit"),
    pytest.param("50mbit", 50_000_000, id="50mbit"),
    pytest.param("2.5Gbit", 2_500_000_000, id="fraction-upper"),
    pytest.param("12.5mbps", 100_000_000, id="bytes-per-s"),
    pytest.param(" 800kbit ", 800_000, id="spaces"),
    pytest.param(10**6, 10**6, id="number"),
])
def test_parse_rate(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("bad, exc, match", [
    pytest.param("fast", ValueError, "rate must look like", id="word"),
    pytest.param("100mb", ValueError, "rate unit", id="unit"),
    pytest.param("1bit", ValueError, "at least", id="tiny"),
    pytest.param(True, TypeError, "rate", id="bool"),
    pytest.param(None, TypeError, "rate", id="none"),
])
def test_parse_rate_rejects(bad, exc, match):
    with pytest.raises(exc, match=match):
        netns.parse_rate(bad)


def test_format_rate_roundtrip():
    for text in ("50mbit", "1gbit", "800kbit"):
        assert netns.parse_rate(netns.format_rate(netns.parse_rate(text))) == \
            netns.parse_rate(text)


def test_shaped_command_type_check():
    with pytest.raises(TypeError, match="cmd"):
        with netns.shaped_command("echo hi", "50mbit"):  # type: ignore[arg-type]
            pass


_OK, _REASON = netns.available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"shaped namespaces unavailable: {_REASON}")


@needs_netns
@pytest.mark.timeout(60)
def test_shaped_rate_delivered_and_namespace_removed():
    rate = netns.parse_rate("50mbit")
    with netns.shaped_namespace("50mbit") as ns:
        assert ns.name in netns.namespaces()
        qdisc = subprocess.run([*ns.prefix, "tc", "qdisc", "show", "dev", "lo"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
        got = netns.measure_tcp_rate(ns.prefix, 6_250_000)  # ~1 s at 50 Mbit/s
    assert ns.name not in netns.namespaces()
    assert 0.75 * rate <= got <= 1.25 * rate, f"delivered {got / 1e6:.1f} Mbit/s"


@needs_netns
@pytest.mark.timeout(60)
def test_namespace_removed_on_exception_and_leftovers_stopped():
    with pytest.raises(KeyboardInterrupt):
        with netns.shaped_command([sys.executable, "-c", "import time; time.sleep(60)"],
                                  "100mbit") as argv:
            name = argv[3]
            proc = subprocess.Popen(argv)
            assert name in netns.namespaces()
            # `ip netns exec` enters the namespace just before it execs the command; only then
            # is the sleeper a leftover of the namespace (under load that takes a moment)
            deadline = time.monotonic() + 10.0
            while str(proc.pid) not in subprocess.run(
                    ["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                assert time.monotonic() < deadline, "the command never entered the namespace"
                time.sleep(0.02)
            raise KeyboardInterrupt
    assert proc.wait(timeout=10) is not None  # the leftover sleeper was terminated
    assert name not in netns.namespaces()


@pytest.mark.parametrize("text, ms", [("10ms", 10.0), ("0.05s", 50.0), ("500us", 0.5),
                                      (" 2.5ms ", 2.5), (20, 20.0)])
def test_parse_delay(text, ms):
    assert netns.parse_delay(text) == pytest.approx(ms)


@pytest.mark.parametrize("bad, exc", [("10", ValueError), ("fast", ValueError),
                                      ("0ms", ValueError), ("11s", ValueError),
                                      (True, TypeError), (None, TypeError)])
def test_parse_delay_rejects(bad, exc):
    with pytest.raises(exc, match="delay"):
        netns.parse_delay(bad)


def test_split_link():
    assert netns.split_link("100mbit+10ms") == ("100mbit", "10ms")
    assert netns.split_link("1gbit") == ("1gbit", None)
    with pytest.raises(ValueError, match="delay"):
        netns.split_link("1gbit+soon")
    with pytest.raises(ValueError, match="rate"):
        netns.split_link("fast+10ms")


_NETEM, _NETEM_WHY = netns.netem_available() if _OK else (False, _REASON)


@pytest.mark.skipif(not _NETEM, reason=f"netem unavailable: {_NETEM_WHY}")
@pytest.mark.timeout(60)
def test_delay_adds_two_delays_to_a_round_trip():
    with netns.shaped_namespace("1gbit", "20ms") as ns:
        rtt = netns.measure_rtt(ns.prefix)
    with netns.shaped_namespace("1gbit") as ns:
        plain = netns.measure_rtt(ns.prefix)
    assert 0.040 <= rtt - plain <= 0.060, (rtt, plain)


def test_delayed_communicator_completes_no_sooner_than_its_rounds():
    """The latency model (bench.engine.comm_timing): a collective waits at least its ring's
    rounds times the delay after the link is free; collectives queue on the link."""
    import torch

    from bench.engine.comm_timing import delayed_communicator
    from bench.engine.nullcomm import NullCommunicator

    comm = delayed_communicator(NullCommunicator(4, 1), 0.02)  # 3 rounds a ring collective
    x = torch.full((8,), float("nan"))
    t0 = time.perf_counter()
    first = comm.all_gather(torch.empty(32), x)
    second = comm.all_reduce(torch.zeros(4))  # 6 rounds, after the first
    first.wait()
    t1 = time.perf_counter() - t0
    second.wait()
    t2 = time.perf_counter() - t0
    assert t1 >= 3 * 0.02 and t2 >= 9 * 0.02, (t1, t2)
    assert comm.stats["all_gather"]["calls"] == 1  # the inner communicator's counters
