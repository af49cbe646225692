"""The configuration schema's machinery: field declarations with ranges (``_f``), type coercion
with messages that name the dotted key, and dotlist overrides. The sections themselves are the
other modules of :mod:`areal_mega.config`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any

import yaml

from areal_mega.common.errors import ConfigError


def _f(
    default=dataclasses.MISSING,
    *,
    lo=None,
    hi=None,
    choices=None,
    lo_open=False,
    factory=None,
    doc="",
):
    """Declare a field with its allowed range (``lo``/``hi`` inclusive unless ``lo_open``)."""
    meta = {"lo": lo, "hi": hi, "choices": choices, "lo_open": lo_open, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(key: str, value: Any, tp) -> Any:
    """Check ``value`` against annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # Optional[X]: X's own message names the nested key
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, (list, tuple)) and dataclasses.is_dataclass(item_tp):
            return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key)
    else:
        return value
    raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}, got {type(value).__name__}")


def _check_range(key: str, value: Any, meta: dict) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r}: must be one of {choices}")
    if value is None or isinstance(value, (str, bool, list, dict)):
        return
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
    rules = []
    if lo is not None:
        rules.append((value > lo, f"> {lo}") if lo_open else (value >= lo, f">= {lo}"))
    if hi is not None:
        rules.append((value <= hi, f"<= {hi}"))
    if isinstance(value, float) and not math.isfinite(value):  # inf passes `>= lo`
        limits = "".join(f" {'and ' * (i > 0)}{text}" for i, (_, text) in enumerate(rules))
        raise ConfigError(f"{key}={value!r}: must be a finite number{limits}")
    for ok, text in rules:
        if not ok:
            raise ConfigError(f"{key}={value!r}: must be {text}")


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or '<root>'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(
            f"{key}: unknown key; allowed keys under {prefix or '<root>'}: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        choices = fields[name].metadata.get("choices") or ()
        if isinstance(value, bool) and ("off" in choices or "on" in choices):
            value = "on" if value else "off"  # YAML 1.1 reads a bare off/on as a boolean
        value = _coerce(key, value, hints[name])
        _check_range(key, value, fields[name].metadata)
        kwargs[name] = value
    obj = cls(**kwargs)
    for name, f in fields.items():  # defaults are validated too, so a schema typo fails loudly
        if name not in kwargs and not dataclasses.is_dataclass(hints[name]):
            _check_range(f"{prefix}.{name}" if prefix else name, getattr(obj, name), f.metadata)
    return obj


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {dotted}")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
