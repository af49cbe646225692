"""LoRA adapters of the CPU rollout server: reading PEFT adapter directories, SGLang's server
flags and the registry of loaded adapters behind ``/load_lora_adapter``,
``/unload_lora_adapter`` and ``/generate``'s ``lora_path``.

SGLang's rules, kept here (its ``ServerArgs.check_lora_server_args``, ``LoRAManager.
validate_new_adapter``, ``LoRAMemoryPool.can_support``, ``LoRARegistry`` and the tokenizer
manager's ``load_lora_adapter`` / ``unload_lora_adapter`` / ``_resolve_lora_path``):

* ``--lora-paths`` items are ``NAME=PATH``, ``PATH`` (the name is the path) or a JSON object
  ``{"lora_name", "lora_path", "pinned"}``; giving any enables LoRA. Without them
  ``--enable-lora`` needs both ``--max-lora-rank`` and ``--lora-target-modules``; missing ones
  are inferred from the preloaded adapters (largest rank, union of targets). ``all`` stands
  for every supported module and must be alone. ``--max-loaded-loras`` must be at least
  ``--max-loras-per-batch`` and at least the number of ``--lora-paths``;
* an adapter is refused when its rank exceeds ``--max-lora-rank`` or its target modules are
  not enabled (compared as SGLang's stacked names: q/k/v_proj are ``qkv_proj``, gate/up_proj
  ``gate_up_proj``), for DoRA or added tokens, and when its name is loaded already;
* loading beyond ``--max-loaded-loras`` unloads the least recently used unpinned adapter; a
  request naming an adapter evicted that way loads it again; pinning is refused when it would
  leave fewer than one slot of ``--max-loras-per-batch`` unpinned;
* an adapter is unregistered at once by ``/unload_lora_adapter`` (new requests naming it are
  refused) and the answer waits until the requests already using it have finished.

Beyond SGLang, for a server reachable by others: ``/load_lora_adapter`` reads only under
``--lora-allowed-dirs`` (:func:`confine`; symlinks resolved, a path outside is refused with
one message whether it exists or not; the launcher passes the run directory), unreadable or
malformed adapter files (truncated, garbage, rank 0 or null, non-finite weights) are refused
with a ValueError (HTTP 400), and without ``--max-loaded-loras`` at most
:data:`DEFAULT_MAX_LOADED_LORAS` adapters are held (least recently used evicted).

PEFT options this server cannot apply exactly are refused by name (``modules_to_save``, bias
other than ``"none"``, ``fan_in_fan_out``, ``lora_bias``, rank/alpha patterns, target
parameters); ``use_rslora`` is applied as PEFT does (scaling ``alpha / sqrt(r)`` instead of
``alpha / r``), which SGLang does not do.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = [
    "SUPPORTED_TARGETS",
    "LoraAdapter",
    "LoraRegistry",
    "LoraSettings",
    "lora_settings",
    "parse_lora_path_item",
    "read_adapter",
    "stacked_names",
]

# the HF projection names served (SGLang's SUPPORTED_LORA_TARGET_MODULES of dense models)
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_PREFIX = "base_model.model."
DEFAULT_MAX_LOADED_LORAS = 64
"""``--max-loaded-loras`` when not given (at least ``--max-loras-per-batch`` and the number of
``--lora-paths``): adapters a client loads beyond it evict the least recently used."""


def stacked_names(modules) -> set:
    """SGLang's normalised target names: ``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` ->
    ``gate_up_proj``, others unchanged (what ``--lora-target-modules`` is compared with)."""
    return {_STACKED.get(m, m) for m in modules}


def parse_lora_path_item(item: str) -> dict:
    """One ``--lora-paths`` item -> ``{"lora_name", "lora_path", "pinned"}``."""
    item = item.strip()
    if item.startswith("{"):
        d = json.loads(item)
        if not isinstance(d, dict) or "lora_name" not in d or "lora_path" not in d:
            raise ValueError(f"--lora-paths {item!r}: a JSON item needs lora_name and lora_path")
        return {
            "lora_name": str(d["lora_name"]),
            "lora_path": str(d["lora_path"]),
            "pinned": bool(d.get("pinned", False)),
        }
    name, sep, path = item.partition("=")
    if not sep:
        name, path = item, item
    if not name or not path:
        raise ValueError(f"--lora-paths {item!r}: expected NAME=PATH, PATH or JSON")
    return {"lora_name": name, "lora_path": path, "pinned": False}


@dataclass
class LoraSettings:
    """The server's LoRA flags after SGLang's checks (``enabled`` False: LoRA off)."""

    enabled: bool = False
    max_rank: int = 0
    targets: tuple = ()  # HF module names the server applies adapters to
    max_per_batch: int = 8
    max_loaded: Optional[int] = None
    preload: list = field(default_factory=list)  # [{"lora_name", "lora_path", "pinned"}]
    allowed_dirs: tuple = ()  # where /load_lora_adapter may read (none: nowhere)

    def info(self) -> dict:
        """What ``/get_server_info`` shows (SGLang's server-args names)."""
        return {
            "enable_lora": self.enabled,
            "max_lora_rank": self.max_rank or None,
            "lora_target_modules": list(self.targets) or None,
            "max_loras_per_batch": self.max_per_batch,
            "max_loaded_loras": self.max_loaded,
            "lora_paths": list(self.preload),
        }


def lora_settings(
    enable: bool,
    max_rank: Optional[int],
    targets: Optional[list],
    paths: Optional[list],
    max_per_batch: int = 8,
    max_loaded: Optional[int] = None,
    allowed_dirs=None,
) -> LoraSettings:
    """SGLang's ``check_lora_server_args`` on the parsed flags (ValueError naming the flag).
    Reads the configs of ``paths`` to infer a missing rank or target list."""
    if max_per_batch <= 0:
        raise ValueError(f"--max-loras-per-batch={max_per_batch}: must be positive")
    preload = [parse_lora_path_item(p) for p in paths or ()]
    if not (enable or preload):
        return LoraSettings(max_per_batch=max_per_batch)
    mods = set(targets or ())
    if "all" in mods:
        if len(mods) != 1:
            raise ValueError("--lora-target-modules: 'all' must be the only module given")
        mods = set(SUPPORTED_TARGETS)
    bad = sorted(mods - set(SUPPORTED_TARGETS))
    if bad:
        raise ValueError(
            f"--lora-target-modules {bad}: not supported (supported: "
            f"{list(SUPPORTED_TARGETS)} or all)"
        )
    if not preload and not (max_rank and mods):
        raise ValueError(
            "--enable-lora without --lora-paths needs both --max-lora-rank and "
            "--lora-target-modules"
        )
    configs = [read_config(p["lora_path"]) for p in preload]
    rank = max_rank or max(_rank(c, p["lora_name"]) for c, p in zip(configs, preload))
    if not mods:
        for c in configs:
            mods |= set(config_targets(c))
    if max_loaded is not None:
        if max_loaded < max_per_batch:
            raise ValueError(
                f"--max-loaded-loras={max_loaded}: must be >= --max-loras-per-batch={max_per_batch}"
            )
        if len(preload) > max_loaded:
            raise ValueError(
                f"--lora-paths: {len(preload)} adapters exceed --max-loaded-loras={max_loaded}"
            )
    else:
        max_loaded = max(DEFAULT_MAX_LOADED_LORAS, max_per_batch, len(preload))
    return LoraSettings(
        True,
        int(rank),
        tuple(m for m in SUPPORTED_TARGETS if m in mods),
        max_per_batch,
        max_loaded,
        preload,
        tuple(allowed_dirs or ()),
    )


def confine(path: str, allowed) -> str:
    """``path`` with its symlinks resolved when that lies inside one of the ``allowed``
    directories (themselves resolved); ValueError otherwise, the same whether ``path`` exists
    or not and naming no other path. ``allowed`` None: no confinement (operator-given paths)."""
    if allowed is None:
        return path
    real = os.path.realpath(path)
    for d in allowed:
        root = os.path.realpath(d)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    raise ValueError(
        "lora_path is outside the directories this server loads adapters from (--lora-allowed-dirs)"
    )


def read_config(path: str, allowed=None) -> dict:
    """``adapter_config.json`` of adapter directory ``path`` (ValueError if unreadable, or, with
    ``allowed``, if the file resolves outside those directories: :func:`confine`)."""
    f = confine(os.path.join(path, "adapter_config.json"), allowed)
    try:
        with open(f) as fh:
            cfg = json.load(fh, parse_constant=_no_constant)
    except OSError as e:
        raise ValueError(f"cannot read {f}: {e.strerror or 'unreadable'}") from None
    except (ValueError, RecursionError):  # garbage, NaN, nesting beyond the parser
        raise ValueError(f"cannot read {f}: not a valid JSON file") from None
    if not isinstance(cfg, dict) or "r" not in cfg:
        raise ValueError(f"{f}: not a PEFT LoRA config (no 'r')")
    return cfg


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _rank(cfg: dict, name: str) -> int:
    """The adapter's rank ``r``: a positive integer (ValueError naming the adapter)."""
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(
            f"Failed to load {name}: adapter_config r={r!r} must be a positive integer"
        )
    return r


def config_targets(cfg: dict) -> list:
    """The module names a config targets (a regex string is taken as unknown: [])."""
    t = cfg.get("target_modules") or []
    return (
        [t]
        if isinstance(t, str) and t in SUPPORTED_TARGETS
        else []
        if isinstance(t, str)
        else [str(m).split(".")[-1] for m in t]
    )


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: ``weights`` maps a served module name to ``(A [r, in], B [out,
    r])``; ``uid`` is new for every load (SGLang's ``lora_id``)."""

    name: str
    path: str
    rank: int
    scaling: float
    targets: frozenset
    weights: dict
    pinned: bool = False
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    in_flight: int = 0  # requests using it (event-loop thread only)


def _refuse_unsupported(name: str, cfg: dict) -> None:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(
            f"Failed to load {name}: peft_type={cfg.get('peft_type')!r} is not a LoRA adapter"
        )
    if cfg.get("use_dora"):
        raise ValueError(
            f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
        )
    if cfg.get("trainable_token_indices"):
        raise ValueError(
            f"Failed to load {name} because LoRA serving currently doesn't "
            "support adapters that add tokens to the vocabulary"
        )
    for key, ok in (
        ("modules_to_save", lambda v: not v),
        ("bias", lambda v: v in (None, "none")),
        ("fan_in_fan_out", lambda v: not v),
        ("lora_bias", lambda v: not v),
        ("rank_pattern", lambda v: not v),
        ("alpha_pattern", lambda v: not v),
        ("target_parameters", lambda v: not v),
    ):
        if not ok(cfg.get(key)):
            raise ValueError(
                f"Failed to load {name}: adapter_config {key}={cfg.get(key)!r} "
                "is not supported by this server"
            )


def _read_tensors(name: str, path: str, allowed=None) -> dict:
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    for f in (st, pt):
        if not os.path.exists(f):
            continue
        f = confine(f, allowed)
        try:
            if f.endswith(".safetensors"):
                from safetensors.torch import load_file

                out = load_file(f)
            else:
                out = torch.load(f, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - any reader's error: the file is bad, not the server
            raise ValueError(
                f"Failed to load {name}: {os.path.basename(f)} is unreadable "
                "(truncated or not a tensor file)"
            ) from None
        if not isinstance(out, dict) or not all(isinstance(t, torch.Tensor) for t in out.values()):
            raise ValueError(
                f"Failed to load {name}: {os.path.basename(f)} is not a mapping of tensors"
            )
        return out
    raise ValueError(f"{path}: no adapter_model.safetensors (or adapter_model.bin)")


def read_adapter(
    name: str, path: str, settings: LoraSettings, modules: dict, pinned: bool = False, allowed=None
) -> LoraAdapter:
    """Read and check adapter ``path`` against the server's ``settings`` and the served
    ``modules`` (name -> ``nn.Linear``); ValueError naming the problem. ``allowed``: the
    directories the files must resolve into (:func:`confine`; None: any)."""
    given, path = path, confine(path, allowed)
    cfg = read_config(path, allowed)
    _refuse_unsupported(name, cfg)
    r = _rank(cfg, name)
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(
            f"Failed to load {name}: adapter_config lora_alpha={alpha!r} must be a finite number"
        )
    weights: dict = {}
    for key, t in _read_tensors(name, path, allowed).items():
        for part in ("lora_A", "lora_B"):
            if f".{part}." in key:
                mod = key.split(f".{part}.")[0]
                mod = mod[len(_PREFIX) :] if mod.startswith(_PREFIX) else mod
                weights.setdefault(mod, {})[part] = t
                break
        else:
            raise ValueError(
                f"Failed to load {name}: tensor {key!r} is not a LoRA A/B weight "
                "(only lora_A/lora_B of linear layers are supported)"
            )
    targets = frozenset(m.split(".")[-1] for m in weights) or frozenset(config_targets(cfg))
    if r > settings.max_rank or not stacked_names(targets) <= stacked_names(settings.targets):
        raise ValueError(
            f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory "
            "pool configuration. Please ensure that the LoRA adapter's rank is within the "
            f"configured `--max-lora-rank` ({settings.max_rank}) and that the target modules "
            f"({sorted(targets)}) are included in `--lora-target-modules` "
            f"({list(settings.targets)})."
        )
    out: dict = {}
    for mod, ab in weights.items():
        lin = modules.get(mod)
        if lin is None:
            raise ValueError(
                f"Failed to load {name}: module {mod!r} is not a LoRA target of the served model"
            )
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"Failed to load {name}: {mod} lacks lora_A or lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.shape != (r, lin.in_features) or b.shape != (lin.out_features, r):
            raise ValueError(
                f"Failed to load {name}: {mod} has A {list(a.shape)}, B "
                f"{list(b.shape)}; expected [{r}, {lin.in_features}], "
                f"[{lin.out_features}, {r}]"
            )
        if not (
            a.is_floating_point()
            and b.is_floating_point()
            and bool(torch.isfinite(a).all())
            and bool(torch.isfinite(b).all())
        ):
            raise ValueError(f"Failed to load {name}: {mod} has non-finite or non-float weights")
        dt = lin.weight.dtype
        out[mod] = (a.to(dt).contiguous(), b.to(dt).contiguous())
    alpha = float(alpha)
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoraAdapter(name, given, r, scaling, targets, out, pinned)


class LoraRegistry:
    """Loaded adapters by name, in least-recently-used order (event-loop thread only)."""

    def __init__(self, settings: LoraSettings, modules: dict):
        self.settings = settings
        self.modules = modules
        self.loaded: "OrderedDict[str, LoraAdapter]" = OrderedDict()
        self.evicted: dict = {}  # name -> (path, pinned) of adapters evicted for room

    def loaded_adapters(self) -> dict:
        """SGLang's ``loaded_adapters``: name -> path."""
        return {n: a.path for n, a in self.loaded.items()}

    def check_load(self, name: str, pinned: bool) -> None:
        """The checks SGLang makes before reading the adapter (ValueError)."""
        if not self.settings.enabled:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.loaded:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        n_pinned = sum(a.pinned for a in self.loaded.values())
        if pinned and n_pinned >= self.settings.max_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to "
                "pin all slots in the LoRA memory pool to avoid starvation for unpinned "
                "adapters and base models. Please increase your `--max-loras-per-batch` or "
                "load it as unpinned LoRA adapters."
            )

    def add(self, adapter: LoraAdapter) -> list:
        """Register ``adapter`` (checked by :meth:`check_load` and :func:`read_adapter`);
        returns the adapters evicted to stay within ``--max-loaded-loras``."""
        self.check_load(adapter.name, adapter.pinned)
        self.loaded[adapter.name] = adapter
        self.evicted.pop(adapter.name, None)
        gone = []
        limit = self.settings.max_loaded
        while limit is not None and len(self.loaded) > limit:
            victim = next(
                (a for a in self.loaded.values() if not a.pinned and a is not adapter), None
            )
            if victim is None:  # (SGLang keeps the new adapter registered then)
                del self.loaded[adapter.name]
                for g in gone:
                    self.loaded[g.name] = g
                    self.evicted.pop(g.name, None)
                raise ValueError(
                    "Didn't find any LoRA adapters when trying to evict LRU "
                    f"LoRA adapter. Loaded: {list(self.loaded)}"
                )
            del self.loaded[victim.name]
            self.evicted[victim.name] = (victim.path, victim.pinned)
            gone.append(victim)
        return gone

    def remove(self, name: str) -> LoraAdapter:
        """Unregister ``name`` (ValueError with SGLang's message if it is not loaded)."""
        if not self.settings.enabled:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name not in self.loaded:
            raise ValueError(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded)}"
            )
        self.evicted.pop(name, None)
        return self.loaded.pop(name)

    def lookup(self, names: list) -> list:
        """The adapters of ``names`` (None stays None), marked used; ValueError naming the
        first that is not loaded. Names evicted for room must be reloaded first
        (:meth:`to_reload`)."""
        if not self.settings.enabled and any(n is not None for n in names):
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        limit = self.settings.max_loaded
        if limit is not None and len({n for n in names}) > limit:
            raise ValueError(
                f"Received request with {len(set(names))} unique loras requested "
                f"but max loaded loras is {limit}"
            )
        out = []
        for n in names:
            if n is not None and n not in self.loaded:
                raise ValueError(
                    f"The following requested LoRA adapters are not loaded: {n}\n"
                    f"Loaded adapters: {list(self.loaded)}."
                )
            if n is not None:
                self.loaded.move_to_end(n)
            out.append(None if n is None else self.loaded[n])
        return out

    def to_reload(self, names: list) -> list:
        """``[(name, path, pinned)]`` of the ``names`` evicted for room, to load again."""
        seen = dict.fromkeys(n for n in names if n in self.evicted)
        return [(n, *self.evicted[n]) for n in seen]
