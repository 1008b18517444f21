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


def require() -> None:
    """Raise ``RuntimeError`` with the reason when shaped namespaces are not available."""
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"bandwidth emulation (--bandwidth) is not available: {reason}. "
                           "Run as root on Linux with iproute2 installed, or leave "
                           "--bandwidth unset to use the plain loopback.")


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
def shaped_namespace(rate: str | int | float) -> Iterator[ShapedNamespace]:
    """A fresh namespace whose loopback is limited to ``rate``; deleted on exit."""
    bits = parse_rate(rate)
    require()
    ns = ShapedNamespace(f"scape-{os.getpid()}-{secrets.token_hex(4)}", bits)
    try:
        _run(["ip", "netns", "add", ns.name])
        _run([*ns.prefix, "ip", "link", "set", "lo", "up"])
        _run([*ns.prefix, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
              f"{bits}bit", "burst", BURST, "latency", LATENCY])
        yield ns
    finally:
        # Runs on exceptions and KeyboardInterrupt too. A second Ctrl-C during cleanup
        # would still leave the name behind; `ip netns del scape-...` removes it by hand.
        with contextlib.suppress(Exception):
            _stop_processes(ns.name)
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, timeout=30)


@contextlib.contextmanager
def shaped_command(cmd: list[str], rate: str | int | float) -> Iterator[list[str]]:
    """``cmd`` prefixed to run inside a fresh shaped namespace (deleted on exit)."""
    if not isinstance(cmd, (list, tuple)) or not all(isinstance(c, str) for c in cmd):
        raise TypeError(f"cmd must be a list of strings, got {cmd!r}")
    with shaped_namespace(rate) as ns:
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
