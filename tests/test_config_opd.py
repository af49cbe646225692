"""On-policy distillation config: ``algorithm.opd`` against ``teacher.*`` (ConfigErrors naming
the keys), the teacher's tokenizer against the student's, the secret, the preset."""

import json
import shutil
from pathlib import Path

import pytest

from areal_mega.config import (
    ConfigError,
    check_against_model,
    check_same_tokenizer,
    config_to_dict,
    load_config,
)
from areal_mega.config.teacher import tokenizer_signature
from areal_mega.launch.local import algorithm_line
from areal_mega.models.tiny import make_tiny_model
from areal_mega.security import holds_secret

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("opd_models")
    kw = dict(
        arch="llama",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
    )
    return {
        "student": make_tiny_model(d / "student", charset="digits", **kw),
        "teacher": make_tiny_model(d / "teacher", charset="digits", seed=3, **kw),
        "ascii": make_tiny_model(d / "ascii", charset="ascii", **kw),
    }


@pytest.mark.parametrize(
    "override, words",
    [
        (
            ["algorithm.opd=pure"],
            ["algorithm.opd='pure'", "teacher.path", "teacher.server_addrs", "neither"],
        ),
        (
            ["algorithm.opd=add", "teacher.path=t", "teacher.server_addrs=[a:1]"],
            ["teacher.path", "teacher.server_addrs", "both"],
        ),
        (["teacher.path=t"], ["teacher.path='t'", "algorithm.opd='off'"]),
        (["teacher.server_addrs=[a:1]"], ["teacher.server_addrs", "algorithm.opd='off'"]),
        (["algorithm.opd=pure", "teacher.path=t", "mode=sft"], ["algorithm.opd", "mode='sft'"]),
        (
            ["algorithm.opd=pure", "teacher.path=t", "algorithm.dynamic_filter=true"],
            ["algorithm.dynamic_filter", "algorithm.opd='pure'"],
        ),
        (
            [
                "algorithm.opd=pure",
                "teacher.path=t",
                "algorithm.adv_estimator=gae",
                "critic.enabled=true",
            ],
            ["algorithm.opd='pure'", "algorithm.adv_estimator='gae'"],
        ),
        (["algorithm.opd=distill"], ["algorithm.opd", "one of"]),
        (["algorithm.opd=add", "teacher.path=t", "algorithm.opd_coef=0"], ["algorithm.opd_coef"]),
        (["algorithm.opd=add", "teacher.path=t", "teacher.dtype=fp8"], ["teacher.dtype"]),
    ],
)
def test_bad_opd_config_names_the_keys(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_good_opd_configs_load():
    cfg = load_config(TINY, ["algorithm.opd=add", "teacher.path=t", "algorithm.opd_coef=0.3"])
    assert cfg.algorithm.opd == "add" and cfg.algorithm.opd_coef == 0.3
    assert cfg.teacher.path == "t" and cfg.teacher.dtype is None
    assert load_config(TINY).algorithm.opd == "off"  # default: no distillation
    # pure OPD discards the outcome advantage: one sample per prompt is fine with grpo
    one = load_config(TINY, ["algorithm.preset=opd", "teacher.path=t", "rollout.n_samples=1"])
    assert one.rollout.n_samples == 1 and one.algorithm.opd == "pure"
    with pytest.raises(ConfigError, match="rollout.n_samples"):  # add keeps GRPO's check
        load_config(TINY, ["algorithm.opd=add", "teacher.path=t", "rollout.n_samples=1"])
    served = load_config(
        TINY, ["algorithm.opd=pure", "teacher.server_addrs=[h:1,h:2]", "teacher.api_key=k"]
    )
    assert served.teacher.server_addrs == ["h:1", "h:2"]
    assert holds_secret(config_to_dict(served))
    assert not holds_secret(config_to_dict(one))


def test_preset_opd_sets_pure_and_the_dry_run_line_names_the_teacher():
    cfg = load_config(TINY, ["algorithm.preset=opd", "teacher.path=/teach"])
    assert cfg.algorithm.opd == "pure" and cfg.algorithm.opd_coef == 1.0
    assert cfg.algorithm.kl_coef == 0.0 and cfg.algorithm.dynamic_filter is False
    line = algorithm_line(cfg)
    assert "opd=pure" in line and "teacher=/teach" in line
    assert "teacher=" not in algorithm_line(load_config(TINY))


def test_same_tokenizer_passes_and_other_weights_do_not_matter(models):
    check_same_tokenizer(str(models["teacher"]), str(models["student"]))
    sig = tokenizer_signature(str(models["student"]))
    assert sig["vocab"] and sig["added"]  # vocab and the <pad>/<eos>/... tokens


def test_other_vocabulary_is_refused_naming_both_paths(models):
    with pytest.raises(ConfigError) as e:
        check_same_tokenizer(str(models["ascii"]), str(models["student"]))
    msg = str(e.value)
    assert str(models["ascii"]) in msg and str(models["student"]) in msg and "vocab" in msg


def test_other_special_tokens_are_refused(models, tmp_path):
    other = Path(shutil.copytree(models["teacher"], tmp_path / "t2"))
    tj = json.loads((other / "tokenizer.json").read_text())
    tj["added_tokens"][1]["content"] = "<|im_end|>"
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConfigError, match=r"added"):
        check_same_tokenizer(str(other), str(models["student"]))


def test_tokenizer_files_missing_on_one_side(models, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="has no tokenizer file"):
        check_same_tokenizer(str(bare), str(models["student"]))
    assert tokenizer_signature(str(bare)) is None
    check_same_tokenizer(str(bare), str(bare))  # nothing to compare on either side


def test_check_against_model_checks_the_teacher(models, tmp_path):
    base = [f"model.path={models['student']}", "algorithm.opd=pure"]
    check_against_model(load_config(TINY, base + [f"teacher.path={models['teacher']}"]))
    with pytest.raises(ConfigError, match=r"teacher.path=.*model.path=.*different tokenizers"):
        check_against_model(load_config(TINY, base + [f"teacher.path={models['ascii']}"]))
    with pytest.raises(ConfigError, match=r"teacher.path=.*not an HF model directory"):
        check_against_model(load_config(TINY, base + [f"teacher.path={tmp_path}"]))
    served = base + ["teacher.server_addrs=[h:1]"]
    check_against_model(load_config(TINY, served))  # its tokenizer: asked of the servers
    with pytest.raises(ConfigError, match=r"actor.temperature=0.7.*teacher.server_addrs"):
        check_against_model(load_config(TINY, served + ["actor.temperature=0.7"]))
