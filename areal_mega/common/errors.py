"""Errors raised at every layer: :class:`ConfigError` is raised by the config's own checks and
by the low modules that read a config key (allocation, security, trackers, launchers), so it
lives here, below all of them."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A bad configuration key, type or value. The message names the dotted key."""
