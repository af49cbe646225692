"""``algorithm.preset`` (pure resolution and through load_config) and the ``policy_loss`` /
``ratio_level`` pairing."""

from pathlib import Path

import pytest
import yaml

from areal_mega.config import ConfigError, config_from_dict, config_to_dict, load_config
from areal_mega.config.presets import PRESETS, pair_policy_loss, preset_keys, resolve_algorithm
from areal_mega.launch.local import describe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
ALL = ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "cispo", "ppo", "opd"]
# presets whose algorithm needs more than keys: opd needs a teacher
NEEDS = {"opd": ["teacher.path=teacher-dir"]}


def test_the_presets_are_exactly_the_documented_ones():
    assert sorted(PRESETS) == sorted(ALL)
    assert PRESETS["opd"]["algorithm.opd"] == "pure"  # on-policy distillation
    doc = (ROOT / "docs" / "algorithms.md").read_text()
    for name in ALL:
        assert f"| `{name}` |" in doc


@pytest.mark.parametrize("name", ALL)
def test_every_preset_resolves(name):
    out = resolve_algorithm({"algorithm": {"preset": name}})
    alg = out["algorithm"]
    assert alg["preset"] == name
    for key, value in PRESETS[name].items():
        section, leaf = key.split(".", 1)
        assert out[section][leaf] == value
    assert alg["ratio_level"] == ("sequence" if alg["policy_loss"] == "gspo" else "token")


def test_preset_estimator_names_match_the_parallel_estimators():
    assert PRESETS["rloo"]["algorithm.adv_estimator"] == "rloo"
    assert PRESETS["reinforce_pp"]["algorithm.adv_estimator"] == "reinforce_plus_plus"


@pytest.mark.parametrize("name", ALL)
def test_explicit_keys_win(name):
    user = {
        "algorithm": {"preset": name, "loss_agg": "seq_sum_norm", "eps_clip_high": 0.5},
        "critic": {"enabled": False},
    }
    before = repr(user)
    keys = preset_keys(name, user)
    assert "algorithm.loss_agg" not in keys and "critic.enabled" not in keys
    out = resolve_algorithm(user)
    assert out["algorithm"]["loss_agg"] == "seq_sum_norm"
    assert out["algorithm"]["eps_clip_high"] == 0.5
    assert out["critic"]["enabled"] is False
    assert repr(user) == before  # pure: the input is not modified


def test_unknown_preset_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"algorithm\.preset='trpo'.*dapo"):
        resolve_algorithm({"algorithm": {"preset": "trpo"}})
    with pytest.raises(ConfigError, match=r"algorithm\.preset"):
        load_config(TINY, ["algorithm.preset=trpo"])


def _recipe_without(tmp_path, *sections):
    data = yaml.safe_load(TINY.read_text())
    for section in sections:
        data.pop(section, None)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ALL)
def test_load_config_accepts_the_preset_and_keeps_its_values(name, tmp_path):
    # tiny-cpu pins algorithm.adv_estimator etc. (explicit keys win): drop those sections
    cfg = load_config(
        _recipe_without(tmp_path, "algorithm", "critic"),
        [f"algorithm.preset={name}", *NEEDS.get(name, [])],
    )
    written = config_to_dict(cfg)
    assert written["algorithm"]["preset"] == name
    for key, value in PRESETS[name].items():
        section, leaf = key.split(".", 1)
        assert written[section][leaf] == value
    assert f"algorithm (preset {name})" in describe(cfg)


def test_recipe_keys_beat_the_preset():
    cfg = load_config(TINY, ["algorithm.preset=gspo"])  # tiny-cpu sets eps_clip_low: 0.2
    assert cfg.algorithm.eps_clip_low == 0.2
    assert cfg.algorithm.eps_clip_high == PRESETS["gspo"]["algorithm.eps_clip_high"]
    assert cfg.algorithm.policy_loss == "gspo" and cfg.algorithm.ratio_level == "sequence"


def test_dotlist_override_beats_the_preset():
    cfg = load_config(
        TINY,
        ["algorithm.preset=dapo", "algorithm.eps_clip_high=0.3", "algorithm.dynamic_filter=false"],
    )
    assert cfg.algorithm.eps_clip_high == 0.3 and cfg.algorithm.dynamic_filter is False
    assert cfg.algorithm.eps_clip_low == 0.2  # the preset's own value elsewhere


def test_no_preset_changes_nothing():
    cfg = load_config(TINY)
    assert cfg.algorithm.preset is None
    assert cfg.algorithm.policy_loss == "ppo" and cfg.algorithm.ratio_level == "token"


def test_policy_loss_and_ratio_level_pairing():
    assert pair_policy_loss({"policy_loss": "gspo"}) == {"ratio_level": "sequence"}
    assert pair_policy_loss({"policy_loss": "cispo"}) == {"ratio_level": "token"}
    assert pair_policy_loss({"ratio_level": "sequence"}) == {"policy_loss": "gspo"}
    assert pair_policy_loss({"ratio_level": "token"}) == {"policy_loss": "ppo"}
    assert pair_policy_loss({"policy_loss": "ppo", "ratio_level": "sequence"}) == {}
    legacy = config_from_dict({"algorithm": {"ratio_level": "sequence"}})
    assert legacy.algorithm.policy_loss == "gspo"  # old recipes keep their meaning
    assert (
        config_from_dict({"algorithm": {"policy_loss": "gspo"}}).algorithm.ratio_level == "sequence"
    )


@pytest.mark.parametrize(
    "loss,level",
    [("ppo", "sequence"), ("gspo", "token"), ("cispo", "sequence"), ("sapo", "sequence")],
)
def test_contradiction_names_both_keys(loss, level):
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss.*algorithm\.ratio_level"):
        config_from_dict({"algorithm": {"policy_loss": loss, "ratio_level": level}})


def test_preset_gspo_with_explicit_token_ratio_is_a_contradiction():
    with pytest.raises(ConfigError, match=r"algorithm\.ratio_level='token'"):
        load_config(TINY, ["algorithm.preset=gspo", "algorithm.ratio_level=token"])


@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_dual_clip_is_refused_without_a_clipped_surrogate(loss):
    with pytest.raises(ConfigError, match=r"algorithm\.dual_clip_c.*algorithm\.policy_loss"):
        config_from_dict({"algorithm": {"policy_loss": loss, "dual_clip_c": 3.0}})
    assert config_from_dict({"algorithm": {"policy_loss": loss}}).algorithm.policy_loss == loss
