"""Ports for the servers the tests start. A port the kernel hands out (bind to port 0) lies in
its ephemeral range, where any process's next bind(0) or outgoing connection may take it while
the test's server is stopped and started again: in one CI run the UI test's chromedriver took
a vLLM deploy port in the moment the benchmark stopped the speculative server to start the
baseline on it ("Address already in use"; /health then answered chromedriver's 404). Ports
below the ephemeral range are handed out to nobody."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that is free now and below the ephemeral range, chosen at random so that the
    xdist workers seldom try the same one."""
    high = max(ephemeral_low(), LOW + 1000)
    for _ in range(200):
        port = random.randrange(LOW, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {LOW}..{high - 1} after 200 tries")
