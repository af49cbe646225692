"""Safe defaults for the run's secrets: who may read them, where they travel, what they guard.

Two secrets exist: ``dataplane.secret`` (HMAC key of the trajectory data plane and of the
rollout worker's control channel) and ``rollout.api_key`` (bearer key of the rollout servers).

* Files of the run that hold either (``config.yaml``, ``config.resolved.json``, the SGLang
  key file) are written with mode 0600 (:func:`write_run_file`), atomically.
* The API key never goes on a command line (``ps`` and ``/proc/<pid>/cmdline`` show it to every
  user): our CPU server reads it from :data:`API_KEY_ENV`; SGLang has no environment variable
  for it, so it reads it from a 0600 YAML file passed as ``--config`` (SGLang merges that file
  into its arguments in-process).
* ``dataplane.allow_remote=true`` needs ``dataplane.secret`` (:func:`check_remote_secret`,
  called by config validation); the sockets refuse a non-loopback bind without one, too.
* No HTTP server binds a non-loopback address without its API key (:func:`check_bind`): the
  rollout servers refuse ``--host 0.0.0.0`` without one unless told otherwise explicitly (a
  logged opt-out); ``launch.local --serve-node`` needs ``rollout.api_key`` or
  ``rollout.allow_unauthenticated=true``.
* Where the key cannot be in a file the job already reads, it comes from the environment
  (:func:`api_key_from_env`): ``AREAL_ROLLOUT_API_KEY_FILE`` names a file only its owner may
  read, or ``AREAL_ROLLOUT_API_KEY`` holds it; the Slurm script passes it that way, never in
  argv.

No torch, no zmq: every process may import it.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Optional

from areal_mega.common.files import atomic_write
from areal_mega.common.net import is_loopback_host
from areal_mega.common.errors import ConfigError

log = logging.getLogger(__name__)

API_KEY_ENV = "AREAL_ROLLOUT_API_KEY"
"""Environment variable that hands the rollout API key to ``areal_mega.inference.server``
(its ``--api-key`` defaults to it)."""

API_KEY_FILE_ENV = "AREAL_ROLLOUT_API_KEY_FILE"
"""Environment variable naming a file (mode 0600 or stricter) that holds the rollout API key:
how the Slurm script hands it to every step without a command line."""

PRIVATE_MODE = 0o600


def holds_secret(resolved: dict) -> bool:
    """Whether a config dict (``config_to_dict`` shape) carries ``dataplane.secret``,
    ``rollout.api_key``, ``rollout.online.admin_api_key`` or ``teacher.api_key``."""
    rollout = resolved.get("rollout") or {}
    return bool((resolved.get("dataplane") or {}).get("secret")
                or rollout.get("api_key") or (rollout.get("online") or {}).get("admin_api_key")
                or (resolved.get("teacher") or {}).get("api_key"))


SECRET_NAME_PARTS = ("secret", "api_key", "apikey", "password", "passwd", "credential", "hmac",
                     "private_key", "access_key", "auth_token", "access_token")
REDACTED = "<redacted>"


def redact_secrets(tree):
    """A copy of a config tree (dicts / lists / scalars) with the value of every key that
    names a secret (``dataplane.secret``, ``rollout.api_key``, ``teacher.api_key``, and any
    key containing one of :data:`SECRET_NAME_PARTS`, e.g. an agent's ``env.OPENAI_API_KEY``)
    replaced by :data:`REDACTED`; what trackers may log as parameters."""
    if isinstance(tree, dict):
        return {k: (REDACTED if v not in (None, "", {}, []) and _names_secret(k)
                    else redact_secrets(v)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact_secrets(v) for v in tree]
    return tree


def _names_secret(key) -> bool:
    k = str(key).lower().replace("-", "_")
    return any(part in k for part in SECRET_NAME_PARTS) or k.endswith("_token") or k == "token"


def write_run_file(path, text: str, *, private: bool) -> Path:
    """Write ``text`` to ``path`` atomically and durably (fsync'd: a resumed run reads it back;
    :func:`areal_mega.common.files.atomic_write`). ``private=True`` creates it with mode 0600
    (set before any byte is written), so no other user can read it at any moment, and replaces
    a file that was readable before; otherwise the mode follows the umask. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text, durable=True, mode=PRIVATE_MODE if private else None)


def write_sglang_key_file(path, api_key: str) -> Path:
    """The 0600 YAML file handed to SGLang as ``--config``: ``api-key: KEY`` only (SGLang reads
    the file's keys as its command-line flags; the name must end in ``.yaml``)."""
    import yaml

    if not str(path).endswith((".yaml", ".yml")):
        raise ValueError(f"{path}: SGLang reads --config files only when named *.yaml / *.yml")
    return write_run_file(path, yaml.safe_dump({"api-key": str(api_key)}), private=True)


def server_env(api_key: Optional[str]) -> dict:
    """Environment entries that give our CPU rollout server its API key (empty without one)."""
    return {API_KEY_ENV: api_key} if api_key else {}


def check_remote_secret(cfg) -> None:
    """``dataplane.allow_remote=true`` without ``dataplane.secret`` would let anyone who reaches
    the port inject training samples or drive the rollout worker: one ConfigError naming both
    keys."""
    if cfg.dataplane.allow_remote and not cfg.dataplane.secret:
        raise ConfigError("dataplane.allow_remote=true needs dataplane.secret: without a "
                          "shared secret anyone who reaches the data or control port could "
                          "inject training samples or weight updates; set dataplane.secret "
                          "(same value on every process) or dataplane.allow_remote=false")


def api_key_from_env(environ=None) -> Optional[str]:
    """The rollout API key from the environment: the contents of the file named by
    :data:`API_KEY_FILE_ENV` (refused, with a ConfigError naming the variable, when it is
    missing, empty or readable by group or others), else :data:`API_KEY_ENV`; None without
    either."""
    env = os.environ if environ is None else environ
    path = env.get(API_KEY_FILE_ENV)
    if path:
        try:
            st = os.stat(path)
            key = Path(path).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: cannot read it ({e.strerror})") \
                from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: mode "
                              f"{stat.S_IMODE(st.st_mode):04o} lets other users read the key; "
                              "chmod 600 it")
        if not key:
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: the file is empty")
        return key
    return env.get(API_KEY_ENV) or None


def check_bind(host: str, *, authenticated: bool, what: str, fix: str,
               allow_unauthenticated: bool = False) -> None:
    """Refuse (ConfigError) to let ``what`` bind ``host`` when that reaches beyond loopback and
    nothing authenticates its clients; ``fix`` says which flag or key to set. With
    ``allow_unauthenticated`` (an explicit opt-out) it is allowed and logged as a warning."""
    if authenticated or is_loopback_host(host):
        return
    if allow_unauthenticated:
        log.warning("%s binds %s WITHOUT authentication (explicit opt-out): anyone who reaches "
                    "it can drive it", what, host)
        return
    raise ConfigError(f"{what}: binding {host!r} (not loopback) without an API key is refused: "
                      f"anyone who reaches it could drive it; {fix}")
