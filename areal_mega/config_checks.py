"""Checks of a config beyond single fields: combinations of keys, and the model it names.

:func:`validate` holds the cross-field rules (:func:`~areal_mega.config.load_config` runs it
after keys, types and ranges); :func:`check_against_model` checks the config against the model
directory, where one exists: a rollout whose prompt and completion cannot fit the model's
context would only fail later, request by request, on the rollout servers. No torch, no
megatron: the launcher, the trainer and the demo call it first thing.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from areal_mega.checkpoint.value_model import hf_num_labels, is_sequence_classification
from areal_mega.common.net import is_loopback_host
from areal_mega.config_lora import check_lora, check_lora_model
from areal_mega.config_schema import ConfigError
from areal_mega.config_vllm import check_vllm
from areal_mega.data.sources import check_sources
from areal_mega.parallel.allocation import AllocationError, parse_allocation
from areal_mega.security import check_remote_secret
from areal_mega.tracking.base import check_trackers

# advantage estimators that compare the samples of one prompt (areal_mega.algo.estimators)
GROUP_ESTIMATORS = ("rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline")


def model_context(model_path: str) -> Optional[tuple]:
    """``(max_position_embeddings, config.json path)`` of an HF model directory, or None when
    the directory has no config.json or it declares no context length (then nothing can be
    checked). Raises :class:`ConfigError` naming the file when it is not a JSON object."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={model_path!r}: {path} is unreadable: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.path={model_path!r}: {path} is not a JSON object")
    for section in (hf, hf.get("text_config")):  # multimodal configs nest the text model
        n = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, path
    return None


def check_against_model(cfg) -> None:
    """Raise one :class:`ConfigError` naming the keys when, in RL mode, the longest prompt the
    data may hold plus the generation budget (``data.max_prompt_len +
    rollout.max_new_tokens``) exceeds the context of ``model.path`` (``max_position_embeddings``
    of its ``config.json``). Does nothing when the model's context is unknown."""
    check_critic_model(cfg)
    check_teacher_model(cfg)
    check_lora_model(cfg)
    if cfg.mode != "rl":
        return
    check_routing_replay_model(cfg)
    known = model_context(cfg.model.path)
    if known is None:
        return
    context, path = known
    need = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if need > context:
        raise ConfigError(
            f"data.max_prompt_len={cfg.data.max_prompt_len} + rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} = {need} tokens exceeds the model's context of "
            f"{context} (max_position_embeddings in {path}): every such request would be "
            "rejected by the rollout servers; lower data.max_prompt_len or "
            "rollout.max_new_tokens")


def check_routing_replay_model(cfg) -> None:
    """Raise one :class:`ConfigError` naming ``algorithm.routing_replay`` when it is on and
    ``model.path``'s config.json declares a dense model (no ``num_experts``): there are no
    routes to replay. Does nothing when the config cannot be read (the engine checks again)."""
    if cfg.algorithm.routing_replay == "off" or not cfg.model.path:
        return
    path = Path(cfg.model.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(hf, dict) and not (hf.get("num_experts") or hf.get("num_local_experts")):
        raise ConfigError(f"algorithm.routing_replay={cfg.algorithm.routing_replay!r}: "
                          f"model.path={cfg.model.path!r} is a dense model ({path}: model_type="
                          f"{hf.get('model_type')!r}, no num_experts: no mixture-of-experts layers); "
                          "routing replay needs a "
                          "mixture-of-experts model (set algorithm.routing_replay=off)")


def validate(cfg) -> None:
    """Cross-field rules of an :class:`~areal_mega.config.ExperimentConfig` that no single
    field can express."""
    try:
        parse_allocation(cfg.allocation)
    except AllocationError as e:
        raise ConfigError(f"allocation={cfg.allocation!r}: {e}") from None
    check_remote_secret(cfg)
    check_trackers(cfg.logging.trackers)
    try:
        check_sources(cfg.data)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.optimizer.min_lr > cfg.optimizer.lr:
        raise ConfigError(f"optimizer.min_lr={cfg.optimizer.min_lr!r}: must be <= optimizer.lr "
                          f"({cfg.optimizer.lr})")
    gae = cfg.algorithm.adv_estimator == "gae"
    if cfg.mode == "rl" and cfg.algorithm.kl_in_reward and cfg.algorithm.kl_coef > 0 \
            and not gae:
        raise ConfigError("algorithm.kl_in_reward=true: with adv_estimator="
                          f"{cfg.algorithm.adv_estimator!r} the trainer computes advantages "
                          "before the reference forward, so the KL penalty is a loss term "
                          "only; set algorithm.kl_in_reward=false, or use adv_estimator=gae "
                          "with critic.enabled=true (GAE runs after the reference forward)")
    _check_critic(cfg, gae)
    check_lora(cfg)
    check_vllm(cfg)
    _check_opd(cfg)
    _check_policy_loss(cfg.algorithm)
    if cfg.algorithm.kl_coef > 0 and not cfg.ref.enabled:
        raise ConfigError(f"algorithm.kl_coef={cfg.algorithm.kl_coef!r}: needs ref.enabled=true")
    outcome = cfg.algorithm.opd != "pure"     # pure OPD discards the outcome advantage
    if cfg.algorithm.adv_estimator == "grpo" and cfg.mode == "rl" and cfg.rollout.n_samples < 2 \
            and cfg.algorithm.group_norm and outcome:
        raise ConfigError(f"rollout.n_samples={cfg.rollout.n_samples}: GRPO group normalisation "
                          "needs at least 2 samples per prompt")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.mode == "rl" \
            and cfg.rollout.n_samples < 2 and outcome:
        raise ConfigError(f"rollout.n_samples={cfg.rollout.n_samples}: adv_estimator="
                          f"{cfg.algorithm.adv_estimator} compares the samples of a prompt and "
                          "needs at least 2 per prompt (a group of one gets advantage 0)")
    if cfg.eval.every_steps and not cfg.eval.data:
        raise ConfigError(f"eval.every_steps={cfg.eval.every_steps}: eval.data is empty; name "
                          "the evaluation prompt files or set eval.every_steps=0")
    if cfg.algorithm.routing_replay != "off" and cfg.mode != "rl":
        raise ConfigError(f"algorithm.routing_replay={cfg.algorithm.routing_replay!r}: replays "
                          f"rollout routes, so it needs mode=rl, not mode={cfg.mode!r}")
    if cfg.eval.every_steps and cfg.mode != "rl":
        raise ConfigError(f"eval.every_steps={cfg.eval.every_steps}: evaluation during "
                          f"training runs on the rollout servers (mode=rl), not mode="
                          f"{cfg.mode!r}; use python -m areal_mega.eval on the checkpoint")
    r = cfg.rollout
    if r.failure_min_prompts > r.failure_window:
        raise ConfigError(f"rollout.failure_min_prompts={r.failure_min_prompts}: must be <= "
                          f"rollout.failure_window ({r.failure_window})")
    wf = cfg.rollout.workflow
    if wf not in ("rlvr", "multi_turn", "online") and not _is_object_spec(wf):
        raise ConfigError(f"rollout.workflow={wf!r}: must be rlvr, multi_turn, online, "
                          "package.module:Name or path/to/file.py:Name")
    if wf == "online":
        _check_online(cfg.rollout.online)


def _check_online(on) -> None:
    """A gateway beyond loopback needs an admin key, and TLS or the explicit opt-out."""
    if is_loopback_host(on.host):
        if bool(on.tls_cert) != bool(on.tls_key):
            raise ConfigError("rollout.online.tls_cert and rollout.online.tls_key go together")
        return
    if not on.admin_api_key:
        raise ConfigError(f"rollout.online.host={on.host!r} (not loopback) needs "
                          "rollout.online.admin_api_key: anyone who reaches the gateway "
                          "could open sessions")
    if not (on.tls_cert and on.tls_key) and not on.allow_insecure_http:
        raise ConfigError(f"rollout.online.host={on.host!r} (not loopback) needs "
                          "rollout.online.tls_cert and rollout.online.tls_key (session keys "
                          "would travel in clear), or rollout.online.allow_insecure_http=true "
                          "on a trusted network")


def _is_object_spec(spec: str) -> bool:
    """``module:Name`` / ``file.py:Name`` in form (whether it imports is checked at start)."""
    mod, sep, name = spec.rpartition(":")
    return bool(sep and mod and name.isidentifier())


def _check_policy_loss(alg) -> None:
    """``policy_loss`` against ``ratio_level`` (gspo <=> sequence) and ``dual_clip_c``."""
    want = "sequence" if alg.policy_loss == "gspo" else "token"
    if alg.ratio_level != want:
        raise ConfigError(f"algorithm.policy_loss={alg.policy_loss!r} contradicts "
                          f"algorithm.ratio_level={alg.ratio_level!r}: policy_loss="
                          f"{alg.policy_loss} uses the {want} ratio; set them consistently "
                          "(gspo <=> sequence) or leave ratio_level out")
    if alg.dual_clip_c is not None and alg.policy_loss in ("cispo", "sapo"):
        raise ConfigError(f"algorithm.dual_clip_c={alg.dual_clip_c!r}: has no meaning with "
                          f"algorithm.policy_loss={alg.policy_loss!r} (no clipped surrogate); "
                          "set algorithm.dual_clip_c=null")


def _check_critic(cfg, gae: bool) -> None:
    """The critic section against the estimator that uses it."""
    c = cfg.critic
    if cfg.mode != "rl":
        return
    if gae and not c.enabled:
        raise ConfigError("algorithm.adv_estimator='gae': needs a value model; set "
                          "critic.enabled=true (or use adv_estimator=grpo or reinforce)")
    if c.enabled and not gae:
        raise ConfigError(f"critic.enabled=true: only algorithm.adv_estimator='gae' uses the "
                          f"critic, not {cfg.algorithm.adv_estimator!r}; set "
                          "critic.enabled=false or algorithm.adv_estimator=gae")
    if c.min_lr > c.lr:
        raise ConfigError(f"critic.min_lr={c.min_lr!r}: must be <= critic.lr ({c.lr})")
    if c.warmup_steps >= cfg.total_steps and c.enabled:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps}: must be < total_steps="
                          f"{cfg.total_steps}, or the actor never trains")


def check_critic_model(cfg) -> None:
    """Raise one :class:`ConfigError` when ``critic.path`` (RL with a critic) is not an HF
    model directory (no ``config.json`` object there) or is a sequence-classification model
    with other than one label (a value model scores each token with one number)."""
    c = cfg.critic
    if cfg.mode != "rl" or not c.enabled or not c.path:
        return
    path = Path(c.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"critic.path={c.path!r}: not an HF model directory ({path}: "
                          f"{type(e).__name__}: {e})") from None
    if not isinstance(hf, dict) or "model_type" not in hf and "architectures" not in hf:
        raise ConfigError(f"critic.path={c.path!r}: {path} is not a model config "
                          "(no model_type / architectures)")
    if is_sequence_classification(hf.get("architectures")) and hf_num_labels(hf) != 1:
        raise ConfigError(f"critic.path={c.path!r}: {hf['architectures'][0]} with num_labels="
                          f"{hf_num_labels(hf)} ({path}: id2label={hf.get('id2label')}); the "
                          "critic needs a one-label score head (num_labels=1)")


def _check_opd(cfg) -> None:
    """``algorithm.opd`` against the ``teacher`` section: OPD on needs exactly one teacher
    (``teacher.path`` or ``teacher.server_addrs``) and RL; a teacher with OPD off is an error
    (it would cost a forward per step that nothing reads)."""
    alg, t = cfg.algorithm, cfg.teacher
    keys = [k for k, v in (("teacher.path", t.path), ("teacher.server_addrs", t.server_addrs))
            if v]
    if alg.opd == "off":
        if keys:
            raise ConfigError(f"{keys[0]}={getattr(t, keys[0].split('.')[1])!r}: a teacher is "
                              "set but algorithm.opd='off', so nothing would use it; set "
                              "algorithm.opd=pure or add (or algorithm.preset=opd), or remove "
                              f"{' and '.join(keys)}")
        return
    if cfg.mode != "rl":
        raise ConfigError(f"algorithm.opd={alg.opd!r}: on-policy distillation trains on the "
                          f"student's rollouts (mode=rl), not mode={cfg.mode!r}")
    if len(keys) != 1:
        given = "both are set" if keys else "neither is set"
        raise ConfigError(f"algorithm.opd={alg.opd!r}: needs exactly one teacher, "
                          f"teacher.path (in the trainer) or teacher.server_addrs (served); "
                          f"{given}")
    if alg.opd == "pure" and alg.adv_estimator == "gae":
        raise ConfigError("algorithm.opd='pure' replaces the outcome advantages, so "
                          "algorithm.adv_estimator='gae' would train a critic nothing reads; "
                          "use algorithm.opd=add (GAE plus the OPD term) or another estimator")
    if alg.opd == "pure" and alg.dynamic_filter:
        raise ConfigError("algorithm.dynamic_filter=true: drops groups by their outcome reward, "
                          "which algorithm.opd='pure' does not use (every sample carries the "
                          "teacher's signal); set algorithm.dynamic_filter=false or "
                          "algorithm.opd=add")


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
        raise ConfigError(f"{main}: unreadable tokenizer file: {type(e).__name__}: {e}") \
            from None
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
        raise ConfigError(f"{where}: {lacking} has no tokenizer file ({', '.join(_VOCAB_FILES)})"
                          ", so the tokenizers cannot be compared; OPD needs the same one")
    differ = [k for k in ("vocab", "merges", "added") if a[k] != b[k]]
    if differ:
        raise ConfigError(f"{where} have different tokenizers ({', '.join(differ)} differ): "
                          "on-policy distillation compares the teacher's and the student's "
                          "logprobs of the same token ids, so both need the same vocabulary "
                          "and special tokens")


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
            raise ConfigError(f"actor.temperature={cfg.actor.temperature}: a teacher served by "
                              f"teacher.server_addrs={t.server_addrs!r} scores at temperature "
                              "1 (SGLang's prompt logprobs), so the student's logprobs must "
                              "be at 1 too; set actor.temperature=1 or use teacher.path")
        return
    if not (Path(t.path) / "config.json").is_file():
        raise ConfigError(f"teacher.path={t.path!r}: not an HF model directory (no "
                          "config.json)")
    check_same_tokenizer(t.path, cfg.model.path)
