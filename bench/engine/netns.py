"""Bandwidth emulation: run a job's ranks behind a rate-limited loopback.

Ranks on one machine talk over ``lo``, which moves tens of Gbit/s -- far faster than a
cluster link per GPU relative to this workload's compute. To make a run communication-bound
the way a cluster is, the ranks run inside a fresh Linux network namespace whose own loopback
is shaped with a token bucket filter::

    ip netns add NAME
    ip netns exec NAME ip link set lo up
    ip netns exec NAME tc qdisc add dev lo root tbf rate RATE burst 256kb latency 100ms

``tbf`` releases at most ``RATE`` bits per second on average (``burst`` bytes may pass at
once; packets waiting longer than ``latency`` are dropped, and TCP backs off). Every byte the
ranks exchange crosses ``lo`` once, so each rank's sends and receives share the one rate --
a single half-duplex link for the whole job, a harsher model than a full-duplex NIC per node.
The delivered rate of a TCP stream is measured by ``tests/test_netns.py`` and by
``python -m bench.engine.netns --measure RATE``.

A link may also add latency (a link spec ``"RATE+DELAY"``, e.g. ``"100mbit+10ms"``): a
``netem`` qdisc holds every packet ``DELAY`` before the token bucket, its child::

    ip netns exec NAME tc qdisc add dev lo root handle 1: netem delay DELAY limit 100000
    ip netns exec NAME tc qdisc add dev lo parent 1:1 handle 10: tbf rate RATE ...

Each packet crosses ``lo`` once, so a message is delayed ``DELAY`` and a round trip (a
message and its answer, a TCP segment and its acknowledgement) ``2 * DELAY``: the link of two
sites ``DELAY`` apart. ``tests/test_netns.py`` measures the round trip.

    with shaped_namespace("100mbit") as ns:
        subprocess.run(ns.wrap([sys.executable, "-m", "train"]), check=True)

The namespace is deleted on leaving the block, also on exceptions and KeyboardInterrupt;
processes the caller left running inside it are terminated first (SIGTERM, then SIGKILL).
Needs Linux, root (CAP_NET_ADMIN / CAP_SYS_ADMIN) and the ``ip`` and ``tc`` tools;
:func:`available` says whether this machine has them and why not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
"""tc's units: ``*bit`` are bits per second, ``*bps`` are bytes per second (as in tc(8))."""

BURST = "256kb"
"""Token bucket size (tc's ``kb`` is kilobytes). Larger than the 64 KiB loopback MTU."""
LATENCY = "100ms"
"""Longest a packet may wait in the bucket's queue."""


def parse_rate(rate: str | int | float) -> int:
    """Bits per second of a tc-style rate: ``"100mbit"``, ``"1gbit"``, ``"50mbit"``,
    ``"12.5mbps"`` (bytes/s), or a plain number of bits per second."""
    if isinstance(rate, bool):
        raise TypeError(f"rate must be a string like '100mbit' or a number, got {rate!r}")
    if isinstance(rate, (int, float)):
        value, unit = float(rate), "bit"
    elif isinstance(rate, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
        if not m:
            raise ValueError(f"rate must look like '100mbit' or '1gbit', got {rate!r}")
        value, unit = float(m.group(1)), (m.group(2).lower() or "bit")
        if unit not in _RATE_UNITS:
            raise ValueError(f"rate unit must be one of {sorted(_RATE_UNITS)}, got {unit!r} "
                             f"in {rate!r}")
    else:
        raise TypeError(f"rate must be a string like '100mbit' or a number, got "
                        f"{type(rate).__name__}")
    bits = int(round(value * _RATE_UNITS[unit]))
    if bits < 8_000:
        raise ValueError(f"rate must be at least 8kbit, got {rate!r}")
    return bits


def format_rate(bits_per_s: float) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def available() -> tuple[bool, str]:
    """``(True, "")`` when shaped namespaces can be made here, else ``(False, reason)``."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "creating network namespaces and qdiscs needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the '{tool}' tool (iproute2) is not on PATH"
    name = f"scape-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                              timeout=20)
        if made.returncode != 0:
            return False, f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
        probe = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo",
                                "root", "tbf", "rate", "1gbit", "burst", BURST, "latency",
                                LATENCY], capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:
            return False, f"'tc qdisc add ... tbf' failed: {probe.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"probing network namespaces failed: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return True, ""


def netem_available() -> tuple[bool, str]:
    """Whether a namespace's loopback can take a ``netem`` delay here (the kernel's
    ``sch_netem``), and why not."""
    ok, why = available()
    if not ok:
        return ok, why
    name = f"scape-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", name])
        probe = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo",
                                "root", "netem", "delay", "1ms"], capture_output=True,
                               text=True, timeout=30)
        if probe.returncode != 0:
            return False, f"'tc qdisc add ... netem' failed: {probe.stderr.strip()}"
        return True, ""
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def require() -> None:
    """Raise ``RuntimeError`` with the reason when shaped namespaces are not available."""
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"bandwidth emulation (--bandwidth) is not available: {reason}. "
                           "Run as root on Linux with iproute2 installed, or leave "
                           "--bandwidth unset to use the plain loopback.")


def parse_delay(delay: str | int | float) -> float:
    """Milliseconds of a tc-style delay: ``"10ms"``, ``"0.05s"``, ``"500us"``, or a number
    of milliseconds; in (0, 10 s]."""
    if isinstance(delay, bool):
        raise TypeError(f"delay must be a string like '10ms' or a number, got {delay!r}")
    if isinstance(delay, (int, float)):
        ms = float(delay)
    elif isinstance(delay, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*", delay)
        if not m:
            raise ValueError(f"delay must look like '10ms', '0.05s' or '500us', got {delay!r}")
        ms = float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
    else:
        raise TypeError(f"delay must be a string like '10ms' or a number, got "
                        f"{type(delay).__name__}")
    if not 0.0 < ms <= 10_000.0:
        raise ValueError(f"delay must be in (0, 10 s], got {delay!r}")
    return ms


def split_link(link: str) -> tuple[str, str | None]:
    """``"100mbit+10ms"`` -> ``("100mbit", "10ms")``; ``"100mbit"`` -> ``("100mbit", None)``;
    both parts checked."""
    if not isinstance(link, str):
        raise TypeError(f"link must be a string like '100mbit' or '100mbit+10ms', got {link!r}")
    rate, plus, delay = link.partition("+")
    parse_rate(rate)
    if plus:
        parse_delay(delay)
    return rate.strip(), (delay.strip() if plus else None)


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class ShapedNamespace:
    name: str
    """The namespace's name (unique per use)."""
    rate_bps: int
    """Rate of the loopback's token bucket, in bits per second."""

    @property
    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def wrap(self, cmd: list[str]) -> list[str]:
        return [*self.prefix, *cmd]


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)!r} failed ({r.returncode}): {r.stderr.strip()}")


def _stop_processes(name: str, grace_s: float = 2.0) -> None:
    """Terminate what still runs inside namespace ``name`` (the caller's leftovers)."""
    r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                       timeout=20)
    pids = [int(p) for p in r.stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def shaped_namespace(rate: str | int | float,
                     delay: str | int | float | None = None) -> Iterator[ShapedNamespace]:
    """A fresh namespace whose loopback is limited to ``rate`` (and delays every packet by
    ``delay``, module docstring); deleted on exit."""
    bits = parse_rate(rate)
    ms = None if delay is None else parse_delay(delay)
    require()
    ns = ShapedNamespace(f"scape-{os.getpid()}-{secrets.token_hex(4)}", bits)
    try:
        _run(["ip", "netns", "add", ns.name])
        _run([*ns.prefix, "ip", "link", "set", "lo", "up"])
        tbf = ["tbf", "rate", f"{bits}bit", "burst", BURST, "latency", LATENCY]
        if ms is None:
            _run([*ns.prefix, "tc", "qdisc", "add", "dev", "lo", "root", *tbf])
        else:
            _run([*ns.prefix, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:",
                  "netem", "delay", f"{ms}ms", "limit", "100000"])
            _run([*ns.prefix, "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle",
                  "10:", *tbf])
        yield ns
    finally:
        # Runs on exceptions and KeyboardInterrupt too. A second Ctrl-C during cleanup
        # would still leave the name behind; `ip netns del scape-...` removes it by hand.
        with contextlib.suppress(Exception):
            _stop_processes(ns.name)
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, timeout=30)


@contextlib.contextmanager
def shaped_command(cmd: list[str], rate: str | int | float) -> Iterator[list[str]]:
    """``cmd`` prefixed to run inside a fresh shaped namespace (deleted on exit); ``rate``
    may be a link spec with a delay, ``"100mbit+10ms"``."""
    if not isinstance(cmd, (list, tuple)) or not all(isinstance(c, str) for c in cmd):
        raise TypeError(f"cmd must be a list of strings, got {cmd!r}")
    delay = None
    if isinstance(rate, str):
        rate, delay = split_link(rate)
    with shaped_namespace(rate, delay) as ns:
        yield ns.wrap(list(cmd))


# ----------------------------------------------------------------- rate measurement

_RECEIVER = r"""
import socket, sys, time
srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
total, first, last = 0, None, None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    now = time.perf_counter()
    if first is None:
        first = now
        skip = len(chunk)
    total += len(chunk); last = now
print(total, skip, last - first, flush=True)
"""

_SENDER = r"""
import socket, sys
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port))
block = b"\xa5" * (1 << 16)
left = nbytes
while left > 0:
    n = min(left, len(block)); s.sendall(block[:n]); left -= n
s.shutdown(socket.SHUT_WR); s.close()
"""


_ECHO = r"""
import socket, sys, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = conn.recv(1)
    if not b:
        break
    conn.sendall(b)
"""

_PING = r"""
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); s.sendall(b"x"); s.recv(1); rtts.append(time.perf_counter() - t)
print(sorted(rtts)[len(rtts) // 2])
"""


def measure_rtt(prefix: list[str], n: int = 7, timeout: float = 60.0) -> float:
    """Median seconds of a one-byte TCP round trip between two processes started with
    ``prefix`` (e.g. a namespace's)."""
    echo = subprocess.Popen([*prefix, sys.executable, "-c", _ECHO], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert echo.stdout is not None
        port = echo.stdout.readline().strip()
        out = subprocess.run([*prefix, sys.executable, "-c", _PING, port, str(n)], check=True,
                             capture_output=True, text=True, timeout=timeout).stdout
    finally:
        echo.kill()
        echo.wait()
    return float(out)


def measure_tcp_rate(prefix: list[str], nbytes: int, timeout: float = 60.0, *,
                     host: str = "127.0.0.1", sender_prefix: list[str] | None = None) -> float:
    """Delivered rate, bits/s, of one TCP stream of ``nbytes`` between two processes started
    with ``prefix`` (e.g. a namespace's; the sender with ``sender_prefix`` if given, the
    receiver listening on ``host``). Timed at the receiver from its first to its last
    chunk, the first chunk's bytes left out (they arrive before the clock starts)."""
    recv = subprocess.Popen([*prefix, sys.executable, "-c", _RECEIVER, host],
                            stdout=subprocess.PIPE, text=True)
    sender = prefix if sender_prefix is None else sender_prefix
    try:
        assert recv.stdout is not None
        port = int(recv.stdout.readline())
        subprocess.run([*sender, sys.executable, "-c", _SENDER, host, str(port), str(nbytes)],
                       check=True, timeout=timeout)
        out, _ = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    total, skip, seconds = out.split()
    if int(total) != nbytes:
        raise RuntimeError(f"receiver got {total} bytes, expected {nbytes}")
    return 8 * (int(total) - int(skip)) / float(seconds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Measure TCP throughput through a shaped loopback.")
    ap.add_argument("--measure", nargs="+", default=["50mbit", "100mbit", "1gbit"])
    ap.add_argument("--seconds", type=float, default=2.0, help="target length of each transfer")
    args = ap.parse_args(argv)
    ok, reason = available()
    if not ok:
        raise SystemExit(f"not available: {reason}")
    print(f"{'set rate':>10} {'bytes':>12} {'delivered':>12} {'ratio':>6}")
    for rate in args.measure:
        bits = parse_rate(rate)
        nbytes = int(bits / 8 * args.seconds)
        with shaped_namespace(bits) as ns:
            got = measure_tcp_rate(ns.prefix, nbytes)
        print(f"{format_rate(bits):>10} {nbytes:>12,} {format_rate(got):>12} "
              f"{got / bits:>6.3f}")
    unshaped = measure_tcp_rate([], 1 << 30)
    print(f"{'unshaped':>10} {1 << 30:>12,} {format_rate(unshaped):>12}")


if __name__ == "__main__":
    main()
