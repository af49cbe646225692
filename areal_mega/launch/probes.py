"""Readiness probes for :class:`~areal_mega.launch.supervisor.ProcessSpec`: callables that
are true once a process serves (a TCP port accepts connections, an HTTP URL answers)."""
from __future__ import annotations

import socket
import urllib.error
import urllib.request
from typing import Callable, Optional


def tcp_ready(host: str, port: int, timeout: float = 1.0) -> Callable[[], bool]:
    """A probe that is true once something accepts TCP connections on ``host:port``."""
    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            return False
    return probe


def http_ready(url: str, timeout: float = 2.0, api_key: Optional[str] = None
               ) -> Callable[[], bool]:
    """A probe that is true once ``url`` answers with a status below 500 (up, if not healthy
    yet a 503 keeps waiting)."""
    def probe() -> bool:
        req = urllib.request.Request(url)
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status < 500
        except urllib.error.HTTPError as e:
            return e.code < 500
        except (OSError, ValueError):
            return False
    return probe
