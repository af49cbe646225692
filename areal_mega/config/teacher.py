"""The ``teacher`` section of the experiment config (on-policy distillation, ``algorithm.opd``)
and its checks: exactly one teacher when OPD is on, and the teacher against the student (an HF
directory with the same tokenizer, or served at temperature 1)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.config.schema import _f

__all__ = [
    "TeacherConfig",
    "check_opd",
    "check_same_tokenizer",
    "check_teacher_model",
    "tokenizer_signature",
]


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (``algorithm.opd``): in the trainer (``path``) or
    served (``server_addrs``); exactly one of the two when OPD is on (docs/algorithms.md)."""

    path: str = _f(
        "",
        doc="HF directory of a teacher run in the trainer as a forward-only "
        "Megatron engine (like the reference model, on the trainer's layout)",
    )
    dtype: Optional[str] = _f(
        None,
        choices=[None, "fp32", "bf16", "fp16"],
        doc="the in-trainer teacher's dtype; None = model.dtype",
    )
    server_addrs: list = _f(
        factory=list,
        doc="host:port of SGLang-compatible servers serving "
        "the teacher (scored by prompt logprobs through SGLang's /generate"
        "; not vLLM servers) instead of teacher.path",
    )
    api_key: Optional[str] = _f(None, doc="Bearer key of the teacher servers")
    request_timeout_s: float = _f(
        600.0, lo=0.0, lo_open=True, doc="per scoring request to a teacher server"
    )


def check_opd(cfg) -> None:
    """``algorithm.opd`` against the ``teacher`` section: OPD on needs exactly one teacher
    (``teacher.path`` or ``teacher.server_addrs``) and RL; a teacher with OPD off is an error
    (it would cost a forward per step that nothing reads)."""
    alg, t = cfg.algorithm, cfg.teacher
    keys = [k for k, v in (("teacher.path", t.path), ("teacher.server_addrs", t.server_addrs)) if v]
    if alg.opd == "off":
        if keys:
            raise ConfigError(
                f"{keys[0]}={getattr(t, keys[0].split('.')[1])!r}: a teacher is "
                "set but algorithm.opd='off', so nothing would use it; set "
                "algorithm.opd=pure or add (or algorithm.preset=opd), or remove "
                f"{' and '.join(keys)}"
            )
        return
    if cfg.mode != "rl":
        raise ConfigError(
            f"algorithm.opd={alg.opd!r}: on-policy distillation trains on the "
            f"student's rollouts (mode=rl), not mode={cfg.mode!r}"
        )
    if len(keys) != 1:
        given = "both are set" if keys else "neither is set"
        raise ConfigError(
            f"algorithm.opd={alg.opd!r}: needs exactly one teacher, "
            f"teacher.path (in the trainer) or teacher.server_addrs (served); "
            f"{given}"
        )
    if alg.opd == "pure" and alg.adv_estimator == "gae":
        raise ConfigError(
            "algorithm.opd='pure' replaces the outcome advantages, so "
            "algorithm.adv_estimator='gae' would train a critic nothing reads; "
            "use algorithm.opd=add (GAE plus the OPD term) or another estimator"
        )
    if alg.opd == "pure" and alg.dynamic_filter:
        raise ConfigError(
            "algorithm.dynamic_filter=true: drops groups by their outcome reward, "
            "which algorithm.opd='pure' does not use (every sample carries the "
            "teacher's signal); set algorithm.dynamic_filter=false or "
            "algorithm.opd=add"
        )


#: tokenizer files whose vocabulary is compared (the first found wins)
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def tokenizer_signature(hf_dir: str) -> Optional[dict]:
    """What must agree between a teacher's and a student's tokenizer: ``vocab`` (token ->
    id, or the hash of a sentencepiece / vocab.txt file), ``merges`` (BPE) and ``added``
    (id -> (content, special) of the added / special tokens, from ``tokenizer.json`` and
    ``tokenizer_config.json``'s ``added_tokens_decoder``). None when ``hf_dir`` holds no
    tokenizer file. Raises :class:`ConfigError` naming an unreadable file."""
    root = Path(hf_dir)
    found = [root / n for n in _VOCAB_FILES if (root / n).is_file()]
    if not found:
        return None
    main = found[0]
    added: dict = {}
    try:
        if main.name == "tokenizer.json":
            tj = json.loads(main.read_text())
            model = tj.get("model") or {}
            vocab, merges = model.get("vocab"), model.get("merges")
            for tok in tj.get("added_tokens") or []:
                added[int(tok["id"])] = (tok.get("content"), bool(tok.get("special")))
        elif main.name == "vocab.json":
            vocab = json.loads(main.read_text())
            m = root / "merges.txt"
            merges = m.read_text().splitlines() if m.is_file() else None
        else:
            vocab, merges = hashlib.sha256(main.read_bytes()).hexdigest(), None
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            decoder = json.loads(cfg_file.read_text()).get("added_tokens_decoder") or {}
            for i, tok in decoder.items():
                added.setdefault(int(i), (tok.get("content"), bool(tok.get("special"))))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{main}: unreadable tokenizer file: {type(e).__name__}: {e}") from None
    return {"vocab": vocab, "merges": merges, "added": added}


def check_same_tokenizer(teacher_path: str, model_path: str) -> None:
    """Raise one :class:`ConfigError` naming both paths when the teacher's tokenizer differs
    from the student's in vocabulary, merges or added / special tokens (OPD compares their
    logprobs of the same token ids), or when only one of them has tokenizer files. Two
    directories without tokenizer files cannot be compared and pass. The special-token roles
    (which token is ``eos_token``) are not compared: a chat teacher and a base student of one
    family score the same ids."""
    a, b = tokenizer_signature(teacher_path), tokenizer_signature(model_path)
    if a is None and b is None:
        return
    where = f"teacher.path={teacher_path!r} and model.path={model_path!r}"
    if a is None or b is None:
        lacking = teacher_path if a is None else model_path
        raise ConfigError(
            f"{where}: {lacking} has no tokenizer file ({', '.join(_VOCAB_FILES)})"
            ", so the tokenizers cannot be compared; OPD needs the same one"
        )
    differ = [k for k in ("vocab", "merges", "added") if a[k] != b[k]]
    if differ:
        raise ConfigError(
            f"{where} have different tokenizers ({', '.join(differ)} differ): "
            "on-policy distillation compares the teacher's and the student's "
            "logprobs of the same token ids, so both need the same vocabulary "
            "and special tokens"
        )


def check_teacher_model(cfg) -> None:
    """The OPD teacher against the student: an in-trainer teacher (``teacher.path``) must be
    an HF model directory with the student's tokenizer (:func:`check_same_tokenizer`).
    A served teacher (``teacher.server_addrs``) scores at temperature 1 (SGLang's prompt
    logprobs), so ``actor.temperature`` must be 1; its tokenizer is checked when the trainer
    first asks the servers (``train.teacher.build_teacher_scorer``)."""
    t = cfg.teacher
    if cfg.mode != "rl" or cfg.algorithm.opd == "off":
        return
    if t.server_addrs:
        if cfg.actor.temperature != 1.0:
            raise ConfigError(
                f"actor.temperature={cfg.actor.temperature}: a teacher served by "
                f"teacher.server_addrs={t.server_addrs!r} scores at temperature "
                "1 (SGLang's prompt logprobs), so the student's logprobs must "
                "be at 1 too; set actor.temperature=1 or use teacher.path"
            )
        return
    if not (Path(t.path) / "config.json").is_file():
        raise ConfigError(f"teacher.path={t.path!r}: not an HF model directory (no config.json)")
    check_same_tokenizer(t.path, cfg.model.path)
