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
import re
import stat
from pathlib import Path
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.common.files import atomic_write
from areal_mega.common.net import is_loopback_host

log = logging.getLogger(__name__)

API_KEY_ENV = "AREAL_ROLLOUT_API_KEY"
"""Environment variable that hands the rollout API key to ``areal_mega.inference.server``
(its ``--api-key`` defaults to it)."""

API_KEY_FILE_ENV = "AREAL_ROLLOUT_API_KEY_FILE"
"""Environment variable naming a file (mode 0600 or stricter) that holds the rollout API key:
how the Slurm script hands it to every step without a command line."""

PRIVATE_MODE = 0o600


def holds_secret(resolved: dict) -> bool:
    """Whether a config dict (``config_to_dict`` shape) carries a secret: ``dataplane.secret``,
    ``rollout.api_key``, ``rollout.online.admin_api_key``, ``teacher.api_key``, or any value
    :func:`redact_secrets` would hide (a secret-named key anywhere, e.g. in
    ``rollout.workflow_kwargs``; a password in a URL; the value of a secret-named environment
    variable)."""
    rollout = resolved.get("rollout") or {}
    return bool(
        (resolved.get("dataplane") or {}).get("secret")
        or rollout.get("api_key")
        or (rollout.get("online") or {}).get("admin_api_key")
        or (resolved.get("teacher") or {}).get("api_key")
        or redact_secrets(resolved) != resolved
    )


SECRET_NAME_PARTS = (
    "secret",
    "api_key",
    "apikey",
    "password",
    "passwd",
    "credential",
    "hmac",
    "private_key",
    "access_key",
    "auth_token",
    "access_token",
)
"""A key containing one of these names a secret whatever its value's type."""
SECRET_STRING_PARTS = ("token", "pass", "authorization", "cookie", "bearer")
"""A key containing one of these names a secret when its value is a string (``max_new_tokens``
and ``eval.pass_threshold`` are numbers, never hidden)."""
SECRET_STRING_SUFFIXES = ("_key", "_pat")
"""A key ending in one of these (``OPENAI_KEY``, ``SERPER_KEY``, ``GH_PAT``) names a secret when
its value is a string, except :data:`NOT_SECRET_NAMES`."""
NOT_SECRET_NAMES = frozenset(
    {
        "prompt_key",
        "answer_key",
        "tls_key",
        "sort_key",
        "group_key",
        "cache_key",
        "text_key",
        "label_key",
        "messages_key",
        "reward_key",
        "id_key",
        "image_key",
        "images_key",
        "dataset_key",
    }
)
"""Keys ending in ``_key`` that name a field or a file, not a secret."""
REDACTED = "<redacted>"
MIN_SECRET_CHARS = 6
"""A secret's value shorter than this is hidden where its key names it, but not searched for in
free text (``"on"`` or ``"1"`` would hide every such word)."""
_SPECIAL_TOKEN = re.compile(
    r"^(pad|eos|bos|unk|sep|cls|mask|stop|special|additional_special)"
    r"_tokens?$"
)
_URL_CREDENTIALS = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)"
    r"(?P<pw>[^@/\s]+)(?P<at>@)"
)

_known_values: set = set()


def redact_secrets(tree, values=None):
    """A copy of a config tree (dicts / lists / scalars) with every secret hidden
    (:data:`REDACTED`): the value of every key that names one (``dataplane.secret``,
    ``rollout.api_key``, :data:`SECRET_NAME_PARTS`; string values under
    :data:`SECRET_STRING_PARTS` / :data:`SECRET_STRING_SUFFIXES` names, e.g. an agent's
    ``env.OPENAI_KEY`` or an ``Authorization`` header in ``rollout.workflow_kwargs``), the
    password of every URL (``http://user:<redacted>@host``), and every occurrence of a secret's
    value in any other string: the tree's own secrets, those of secret-named environment
    variables, those registered with :func:`register_secrets`, and ``values``. What trackers
    may log as parameters."""
    found = secret_values(tree) | known_secrets()
    if values:
        found |= {str(v) for v in values if v and len(str(v)) >= MIN_SECRET_CHARS}
    return _redact_tree(tree, _ordered(found))


def _redact_tree(tree, ordered):
    if isinstance(tree, dict):
        return {
            k: (REDACTED if _hides(k, v) else _redact_tree(v, ordered)) for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        return [_redact_tree(v, ordered) for v in tree]
    if isinstance(tree, str):
        return _redact_string(tree, ordered)
    return tree


def _hides(key, value) -> bool:
    """Whether the value of ``key`` is hidden whole."""
    if value in (None, "", {}, []):
        return False
    if _names_secret(key):
        return True
    return isinstance(value, str) and _names_secret_string(key)


def _names_secret(key) -> bool:
    k = str(key).lower().replace("-", "_")
    return any(part in k for part in SECRET_NAME_PARTS) or k.endswith("_token") or k == "token"


def _names_secret_string(key) -> bool:
    k = str(key).lower().replace("-", "_")
    if k in NOT_SECRET_NAMES or _SPECIAL_TOKEN.match(k):
        return False
    return (
        any(part in k for part in SECRET_STRING_PARTS)
        or k.endswith(SECRET_STRING_SUFFIXES)
        or k in ("key", "pat")
    )


def secret_values(tree) -> set:
    """The secrets' values a config tree holds (long enough to search for in free text): the
    string values of secret-named keys, the parts after ``Bearer``/``Basic``, URL passwords."""
    out: set = set()

    def add(v) -> None:
        v = str(v).strip()
        if len(v) >= MIN_SECRET_CHARS:
            out.add(v)
        parts = v.split(None, 1)
        if len(parts) == 2 and parts[0].lower() in ("bearer", "basic", "token"):
            add(parts[1])

    def walk(node, key=None) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, key)
        elif isinstance(node, str):
            if key is not None and _hides(key, node) and not _SPECIAL_TOKEN.match(str(key).lower()):
                add(node)
            for m in _URL_CREDENTIALS.finditer(node):
                add(m.group("pw"))
        elif (
            key is not None
            and _hides(key, node)
            and isinstance(node, (int, float))
            and not isinstance(node, bool)
        ):
            add(node)

    walk(tree)
    return out


def env_secret_values(environ=None) -> set:
    """The values of the environment variables whose names name a secret (``OPENAI_KEY``,
    ``HF_TOKEN``, ``DB_PASS``, ``GH_PAT``) and the passwords of URLs in any variable."""
    env = os.environ if environ is None else environ
    return secret_values(dict(env))


def register_secrets(values) -> None:
    """Remember ``values`` as secrets of this process: :func:`redact_text` and
    :func:`redact_secrets` hide them from then on (values shorter than
    :data:`MIN_SECRET_CHARS` are ignored)."""
    _known_values.update(str(v) for v in values if v and len(str(v)) >= MIN_SECRET_CHARS)


def known_secrets() -> set:
    """The registered secrets and those of the environment now."""
    return _known_values | env_secret_values()


def _ordered(values) -> list:
    return sorted(values, key=len, reverse=True)  # a secret inside a longer one: longer first


def _redact_string(text: str, ordered) -> str:
    for v in ordered:
        if v in text:
            text = text.replace(v, REDACTED)
    return _URL_CREDENTIALS.sub(lambda m: m.group("head") + REDACTED + m.group("at"), text)


def redact_text(text: str, values=None) -> str:
    """``text`` with every known secret (:func:`known_secrets`, plus ``values``) and every URL
    password replaced by :data:`REDACTED`: for logs, samples and anything else written."""
    found = known_secrets()
    if values:
        found = found | {str(v) for v in values if v and len(str(v)) >= MIN_SECRET_CHARS}
    return _redact_string(str(text), _ordered(found))


class _RedactingFactory:
    """A log record factory whose records carry their message with every secret hidden."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        record = self.inner(*args, **kwargs)
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format is the logging module's to report
            return record
        clean = redact_text(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return record


def install_log_redaction(tree=None) -> None:
    """Register the secrets of ``tree`` (a config dict) and make every log record of this
    process hide the known secrets (:func:`redact_text`) from then on; idempotent."""
    if tree is not None:
        register_secrets(secret_values(tree))
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RedactingFactory):
        logging.setLogRecordFactory(_RedactingFactory(factory))


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
        raise ConfigError(
            "dataplane.allow_remote=true needs dataplane.secret: without a "
            "shared secret anyone who reaches the data or control port could "
            "inject training samples or weight updates; set dataplane.secret "
            "(same value on every process) or dataplane.allow_remote=false"
        )


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
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: cannot read it ({e.strerror})") from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"{API_KEY_FILE_ENV}={path}: mode "
                f"{stat.S_IMODE(st.st_mode):04o} lets other users read the key; "
                "chmod 600 it"
            )
        if not key:
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: the file is empty")
        return key
    return env.get(API_KEY_ENV) or None


def check_bind(
    host: str, *, authenticated: bool, what: str, fix: str, allow_unauthenticated: bool = False
) -> None:
    """Refuse (ConfigError) to let ``what`` bind ``host`` when that reaches beyond loopback and
    nothing authenticates its clients; ``fix`` says which flag or key to set. With
    ``allow_unauthenticated`` (an explicit opt-out) it is allowed and logged as a warning."""
    if authenticated or is_loopback_host(host):
        return
    if allow_unauthenticated:
        log.warning(
            "%s binds %s WITHOUT authentication (explicit opt-out): anyone who reaches "
            "it can drive it",
            what,
            host,
        )
        return
    raise ConfigError(
        f"{what}: binding {host!r} (not loopback) without an API key is refused: "
        f"anyone who reaches it could drive it; {fix}"
    )
