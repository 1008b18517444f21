"""Two emulated nodes: a slow link between them, the fast loopback inside each.

Each node is a network namespace; a veth pair joins them, and each end's egress is shaped
with the same token bucket as :mod:`bench.engine.netns` (``tc ... tbf rate RATE``), so each
direction of the link carries at most ``RATE`` (a full-duplex NIC shared by the node's
ranks). Inside a namespace the ranks reach each other, and their own node's address, over
that namespace's loopback, which is not shaped::

    node 0: netns scape-n0-*, 10.77.0.1 on scape0 --veth, tbf RATE each way-- node 1: 10.77.0.2

A rank enters its node's namespace before it opens any socket (:func:`enter`, the
``setns(2)`` call that ``ip netns exec`` makes), and gloo is told to use ``scape0``
(``GLOO_SOCKET_IFNAME``). :func:`measure` shows the link delivers its rate and the loopback
is not shaped. The namespaces (and the veth pair with them) are deleted on leaving the block.
Needs what :mod:`bench.engine.netns` needs (Linux, root, ``ip``, ``tc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess
from collections.abc import Iterator

from bench.engine.netns import BURST, LATENCY, _run, _stop_processes, measure_tcp_rate, parse_rate
from bench.engine.netns import require as require

NODE_IF = "scape0"
"""The name of the node's end of the link, inside every node's namespace."""
_CLONE_NEWNET = 0x40000000


def address(node: int) -> str:
    """The IPv4 address of node ``node`` on the link."""
    return f"10.77.0.{node + 1}"


@contextlib.contextmanager
def node_namespaces(rate: str | int | float) -> Iterator[list[str]]:
    """Two namespaces joined by a link of ``rate`` each way; yields their names."""
    bits = parse_rate(rate)
    require()
    tag = secrets.token_hex(3)
    names = [f"scape-n{i}-{os.getpid()}-{tag}" for i in range(2)]
    ends = [f"sv{tag}{i}" for i in range(2)]
    try:
        for name in names:
            _run(["ip", "netns", "add", name])
            _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        _run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]])
        for i, (name, end) in enumerate(zip(names, ends)):
            ns = ["ip", "netns", "exec", name]
            _run(["ip", "link", "set", end, "netns", name])
            _run([*ns, "ip", "link", "set", end, "name", NODE_IF])
            _run([*ns, "ip", "addr", "add", f"{address(i)}/24", "dev", NODE_IF])
            _run([*ns, "ip", "link", "set", NODE_IF, "up"])
            _run([*ns, "tc", "qdisc", "add", "dev", NODE_IF, "root", "tbf", "rate",
                  f"{bits}bit", "burst", BURST, "latency", LATENCY])
        yield names
    finally:
        for name in names:
            with contextlib.suppress(Exception):
                _stop_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", ends[0]], capture_output=True, timeout=30)


def enter(name: str) -> None:
    """Move the calling process into namespace ``name`` (before it opens sockets)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def measure(names: list[str], nbytes: int) -> dict[str, float]:
    """Delivered rates, bits/s: one TCP stream from node 1 to node 0 over the link, and one
    inside node 0 over its loopback (which must not be shaped)."""
    ns0, ns1 = (["ip", "netns", "exec", n] for n in names)
    return {"link_bps": measure_tcp_rate(ns0, nbytes, host=address(0), sender_prefix=ns1),
            "inside_bps": measure_tcp_rate(ns0, 8 * nbytes, host=address(0))}
