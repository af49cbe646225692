"""Ports and readiness: free TCP ports, and probes that tell whether a process serves yet.

A probe is a callable returning a bool; whoever waits polls it (the launcher's supervisor, a
server handle's ``wait_ready``).
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import random
import socket
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable, Optional


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only: ``localhost`` or a loopback address
    (``127.x``, ``::1``). Every other name, ``0.0.0.0`` / ``::`` / ``*`` and hostnames
    included, counts as reachable from the network (pure)."""
    host = str(host).strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PICKED_PORT = 10000  # below: well-known and registered services


def ephemeral_port_range(path: str = EPHEMERAL_RANGE_FILE) -> Optional[tuple]:
    """``(low, high)``: the ports the kernel hands out as the source port of an outgoing
    connection (Linux; None where the file is missing or unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def quiet_ports(ephemeral: Optional[tuple]) -> list:
    """The ports from LOWEST_PICKED_PORT up that lie outside ``ephemeral`` (pure): no outgoing
    connection takes one of them between our pick and its user's bind. Empty when the
    ephemeral range is unknown or leaves fewer than 1000 such ports."""
    if ephemeral is None:
        return []
    low, high = ephemeral
    ports = [p for p in range(LOWEST_PICKED_PORT, 65536) if not low <= p <= high]
    return ports if len(ports) >= 1000 else []


PORT_CLAIM_S = 180.0
"""How long a port :func:`free_ports` handed out stays claimed against other callers on this
machine: longer than any of our processes takes from being given a port to binding it."""


def port_claims_dir() -> str:
    """The directory of this user's port claims (``$TMPDIR/areal-mega-ports-<uid>``)."""
    return os.path.join(tempfile.gettempdir(), f"areal-mega-ports-{os.getuid()}")


def claim_port(port: int, claims: Optional[str] = None, now: Optional[float] = None) -> bool:
    """Claim ``port`` for :data:`PORT_CLAIM_S` against every process on this machine that picks
    ports through :func:`free_ports`: False while another caller's claim is fresh. A port that
    is free when picked can still be taken before its user binds it (a server boots for
    seconds first); two runs' launchers, or a test run's two workers, would otherwise draw the
    same one in that window. Best effort: an unwritable directory claims nothing."""
    claims = claims or port_claims_dir()
    now = time.time() if now is None else now
    path = os.path.join(claims, str(port))
    try:
        os.makedirs(claims, mode=0o700, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if now - os.stat(path).st_mtime < PORT_CLAIM_S:
                return False
            os.utime(path, (now, now))  # an old claim: take it over
            return True
        os.utime(fd, (now, now))
        os.close(fd)
    except OSError:
        return True
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list:
    """``n`` distinct TCP ports that are free right now on ``host``, for a process that binds
    them later. They are drawn at random outside the kernel's ephemeral range where that is
    known (an ephemeral port the OS picked can be taken by any outgoing connection before its
    user binds it; CI once lost a test to that), and each is claimed for a few minutes against
    the other callers on this machine (:func:`claim_port`; CI lost another test to two picks
    of one port). Each is checked by binding it while the sockets of the ports already picked
    stay open, so they differ; the OS picks the rest if the draw keeps finding busy ports."""
    socks, ports = [], []
    candidates = quiet_ports(ephemeral_port_range())
    draw = random.SystemRandom()  # not the seeded global generator two test workers share
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            for _ in range(100 if candidates else 0):
                port = draw.choice(candidates)
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                if claim_port(port):
                    break
                s.close()
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks[-1] = s
            else:
                s.bind((host, 0))
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that is free right now on ``host`` (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


def tcp_ready(host: str, port: int, timeout: float = 1.0) -> Callable[[], bool]:
    """A probe that is true once something accepts TCP connections on ``host:port``."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            return False

    return probe


def http_ready(
    url: str, timeout: float = 2.0, api_key: Optional[str] = None, *, healthy: bool = False
) -> Callable[[], bool]:
    """A probe that is true once ``GET url`` answers with a status below 500 (the server is
    up; a 503 while it loads keeps waiting), or with ``healthy=True`` only once it answers
    200. ``api_key`` goes in an ``Authorization: Bearer`` header. A malformed ``url`` raises
    ``ValueError`` here, not in the probe."""
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")

    def probe() -> bool:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        except (OSError, ValueError, http.client.HTTPException):
            return False
        return status == 200 if healthy else status < 500

    return probe
