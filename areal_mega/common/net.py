"""Ports and readiness: free TCP ports, and probes that tell whether a process serves yet.

A probe is a callable returning a bool; whoever waits polls it (the launcher's supervisor, a
server handle's ``wait_ready``).
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
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


def free_ports(n: int, host: str = "127.0.0.1") -> list:
    """``n`` distinct TCP ports that are free right now on ``host``. The OS picks each one
    while the sockets of the ports already picked are still open, so they differ; once they
    are closed a tiny race remains (another process may take one before its user binds it)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
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


def http_ready(url: str, timeout: float = 2.0, api_key: Optional[str] = None, *,
               healthy: bool = False) -> Callable[[], bool]:
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
