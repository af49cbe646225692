"""Every float in the configuration must be a finite number: ``optimizer.lr=inf`` used to pass
``lo=0`` (inf >= 0) and trained with a NaN learning rate. The fields are derived from the
dataclasses, so a float added later is covered without touching this file."""

import dataclasses
import typing

import pytest

from areal_mega.config import ConfigError, ExperimentConfig, load_config


def _float_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
        if dataclasses.is_dataclass(inner):
            yield from _float_fields(inner, f"{prefix}{f.name}.")
        elif inner is float:
            yield f"{prefix}{f.name}", f.metadata


FLOATS = list(_float_fields(ExperimentConfig))
RANGED = [key for key, meta in FLOATS if meta.get("lo") is not None or meta.get("hi") is not None]


def test_the_walk_found_the_float_fields():
    keys = [k for k, _ in FLOATS]
    assert {
        "optimizer.lr",
        "optimizer.beta1",
        "algorithm.kl_clamp",
        "algorithm.reward_scale",
    } <= set(keys)
    assert len(RANGED) >= 20


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("key", RANGED)
def test_ranged_float_rejects_non_finite(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    msg = str(e.value)
    assert msg.startswith(f"{key}=") and "finite" in msg, msg


@pytest.mark.parametrize("key", [k for k, _ in FLOATS if k not in RANGED])
def test_unranged_float_rejects_non_finite(key):
    for value in ("inf", "nan"):
        with pytest.raises(ConfigError, match="finite") as e:
            load_config(None, [f"{key}={value}"])
        assert str(e.value).startswith(f"{key}=")


def test_finite_values_still_pass_and_ranges_still_apply():
    cfg = load_config(
        None, ["optimizer.lr=1e-5", "algorithm.kl_clamp=3", "algorithm.reward_scale=-2.5"]
    )
    assert cfg.optimizer.lr == 1e-5 and cfg.algorithm.kl_clamp == 3.0
    assert cfg.algorithm.reward_scale == -2.5
    with pytest.raises(ConfigError, match=r"optimizer\.beta1=1\.5: must be <= 1\.0"):
        load_config(None, ["optimizer.beta1=1.5"])
