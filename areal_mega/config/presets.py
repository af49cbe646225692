"""Algorithm presets (``algorithm.preset``) and the ``policy_loss`` / ``ratio_level`` pairing.

Pure dict logic on the nested config dict, applied by
:func:`areal_mega.config.experiment.config_from_dict` before the dataclasses are built, so the
resolved values are the config's own (written to the run's config, printed by ``--dry-run``).
A preset fills in the keys that define its algorithm; a key the user gave (recipe YAML or
dotlist override) wins. The table with the papers is in docs/algorithms.md.

``rloo`` and ``reinforce_pp`` name the advantage estimators ``rloo`` / ``reinforce_plus_plus``
(added alongside these presets in areal_mega/algo/estimators.py). ``opd`` is on-policy
distillation (areal_mega/algo/distill.py): it needs a ``teacher`` section.
"""

from __future__ import annotations

import copy
from typing import Any

from areal_mega.common.errors import ConfigError

_MISSING = object()

#: preset -> {dotted key: value}. Only the keys that define the algorithm; lengths, learning
#: rates, KL strength (which needs a reference model) stay the user's.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.group_norm": True,
        "algorithm.group_std": True,
        "algorithm.leave_one_out": False,
        "algorithm.policy_loss": "ppo",
        "algorithm.loss_agg": "seq_mean",
        "algorithm.kl_estimator": "k3",
    },
    "dr_grpo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.group_norm": True,
        "algorithm.group_std": False,
        "algorithm.leave_one_out": False,
        "algorithm.policy_loss": "ppo",
        "algorithm.loss_agg": "seq_sum_norm",
        "algorithm.kl_coef": 0.0,
    },
    "dapo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.group_norm": True,
        "algorithm.group_std": True,
        "algorithm.leave_one_out": False,
        "algorithm.policy_loss": "ppo",
        "algorithm.eps_clip_low": 0.2,
        "algorithm.eps_clip_high": 0.28,
        "algorithm.loss_agg": "token_mean",
        "algorithm.dynamic_filter": True,
        "algorithm.kl_coef": 0.0,
    },
    "gspo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.group_norm": True,
        "algorithm.group_std": True,
        "algorithm.policy_loss": "gspo",
        "algorithm.eps_clip_low": 3e-4,
        "algorithm.eps_clip_high": 4e-4,
        "algorithm.loss_agg": "seq_mean",
    },
    "rloo": {
        "algorithm.adv_estimator": "rloo",
        "algorithm.policy_loss": "ppo",
        "algorithm.loss_agg": "token_mean",
    },
    "reinforce_pp": {
        "algorithm.adv_estimator": "reinforce_plus_plus",
        "algorithm.policy_loss": "ppo",
        "algorithm.loss_agg": "token_mean",
    },
    "cispo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.group_norm": True,
        "algorithm.group_std": True,
        "algorithm.policy_loss": "cispo",
        "algorithm.eps_clip_low": 1.0,
        "algorithm.eps_clip_high": 0.2,
        "algorithm.loss_agg": "token_mean",
    },
    "ppo": {
        "algorithm.adv_estimator": "gae",
        "algorithm.policy_loss": "ppo",
        "algorithm.gamma": 1.0,
        "algorithm.lam": 0.95,
        "algorithm.loss_agg": "token_mean",
        "critic.enabled": True,
    },
    # on-policy distillation (needs teacher.path or teacher.server_addrs): the teacher's
    # per-token reverse KL replaces the outcome advantage; no reward filtering, no KL to a
    # reference (the teacher is the anchor)
    "opd": {
        "algorithm.opd": "pure",
        "algorithm.opd_coef": 1.0,
        "algorithm.policy_loss": "ppo",
        "algorithm.loss_agg": "token_mean",
        "algorithm.dynamic_filter": False,
        "algorithm.kl_coef": 0.0,
    },
}


def _get(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def preset_keys(name: str, user: dict) -> dict[str, Any]:
    """The dotted keys preset ``name`` sets given the user's nested config dict ``user``: the
    preset's keys minus those the user gave. Unknown ``name`` -> :class:`ConfigError` naming
    ``algorithm.preset`` and the allowed values."""
    if name not in PRESETS:
        raise ConfigError(f"algorithm.preset={name!r}: must be one of {sorted(PRESETS)}")
    return {k: v for k, v in PRESETS[name].items() if _get(user, k) is _MISSING}


def pair_policy_loss(algorithm: dict) -> dict[str, Any]:
    """Fill in whichever of ``policy_loss`` / ``ratio_level`` the ``algorithm`` dict lacks from
    the other: ``gspo`` <-> ``sequence``, any other policy loss -> ``token``, ``token`` ->
    ``ppo``. Both given: left as they are (a contradiction is a ConfigError of the checks).
    Returns the keys to add."""
    loss, level = algorithm.get("policy_loss"), algorithm.get("ratio_level")
    if loss is not None and level is None:
        return {"ratio_level": "sequence" if loss == "gspo" else "token"}
    if level is not None and loss is None:
        return {"policy_loss": "gspo" if level == "sequence" else "ppo"}
    return {}


def resolve_algorithm(data: dict) -> dict:
    """A copy of the nested config dict ``data`` with ``algorithm.preset`` applied (explicit
    keys win) and ``policy_loss`` / ``ratio_level`` paired (:func:`pair_policy_loss`)."""
    alg = data.get("algorithm")
    if not isinstance(alg, dict):
        return data
    out = copy.deepcopy(data)
    name = alg.get("preset")
    if name is not None:
        for key, value in preset_keys(name, data).items():
            _set(out, key, value)
    out["algorithm"].update(pair_policy_loss(out["algorithm"]))
    return out
