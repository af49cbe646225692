"""One GRPO step, ours against TRL's ``GRPOTrainer``: the same weights and the same batch must
give the same gradient and the same update.

    make trl-env                                        # once: TRL's venv (.venv-trl)
    python -m bench.vs_trl.step                         # a tiny model built here
    python -m bench.vs_trl.step --from runs/vs-trl-X    # the model and data of a vs_trl run

bench/vs_trl/run.py compares whole runs, where sampling noise and our staleness bound (``--eta``)
separate the reward curves; this compares one step with neither. TRL's side
(bench/vs_trl/trl_step.py in .venv-trl) runs one real step of the vs_trl trainer (its own
generation, rewards, advantages, loss, clipping and AdamW) and writes what it trained on: the
samples, their rewards and the log-probabilities of the sampled tokens under the weights that
sampled them (what a rollout server reports). Ours then trains that batch from the same
weights as the trainer's ``rl_step`` does (:func:`bench.grpo_step.grpo_step`: intake planning
with GRPO advantages, packing, the decoupled PPO loss, Megatron's optimizer), with the vs_trl
settings (recipes/tiny-cpu.yaml, lr ``--lr``, no warm-up, clip 1.0, no KL, temperature 1).

Printed: each side's loss and grad norm (before clipping); the advantages (TRL's against ours,
:func:`areal_mega.algo.advantages.group_normalize`); per tensor (HF names, through the
exporter that publishes our weights) the relative difference ``|ours - TRL| / |TRL|`` of the
gradient (TRL's unclipped by its clip factor): the largest and the median over tensors; and
each side's update (weights after - before) against AdamW's first step on its own gradient
(:func:`adamw_first_step`; that step is ~ lr * sign(gradient), so two updates differ wherever
an element's gradient is ~0 however close the gradients are). The sides agree when the
gradients and grad norms are within ``--tol`` of each other (default 1e-2; the known
difference: TRL adds 1e-4 to the group std, we add 1e-6, ~1e-3 of the advantage at these
rewards) and each update is within ``--tol`` of AdamW's. One place the models differ is left
out: the embedding's pad row (HF's ``nn.Embedding(padding_idx=pad)`` gives it no gradient
from lookups of sampled pad tokens; Megatron's embedding does). Written beside:
step.json, ours_grads.safetensors (our gradients, HF names) and TRL's files (trl/).
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.vs_trl.assets import ROOT, make_assets
from bench.vs_trl.run import TRL_PYTHON, _env, require_trl_env


def run_trl_step(a, model: Path, train: Path, out: Path) -> dict:
    """bench/vs_trl/trl_step.py in .venv-trl; returns its batch.json."""
    cmd = [
        str(TRL_PYTHON),
        "-m",
        "bench.vs_trl.trl_step",
        "--model",
        str(model),
        "--train",
        str(train),
        "--out",
        str(out),
        "--prompts",
        str(a.prompts),
        "--group",
        str(a.group),
        "--max-new",
        str(a.max_new),
        "--lr",
        str(a.lr),
        "--seed",
        str(a.seed),
        "--threads",
        str(a.threads),
    ]
    log = out.with_suffix(".log")
    out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, env=_env(a.threads), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        ).returncode
    if rc != 0 or not (out / "batch.json").exists():
        raise SystemExit(f"TRL's step failed (exit {rc}); see {log}")
    return json.loads((out / "batch.json").read_text())


def trajectories(trl: dict) -> list:
    """TRL's samples as the intake hands them to the trainer: behaviour logprobs of weight
    version 0, one group per ``group`` consecutive samples (TRL's order)."""
    import numpy as np

    from areal_mega.dataplane.trajectory import Trajectory

    out = []
    for i, s in enumerate(trl["samples"]):
        c = s["completion_ids"]
        g = i // trl["group"]
        out.append(
            Trajectory.from_tokens(
                s["prompt_ids"],
                c,
                s["logprobs"],
                np.zeros(len(c)),
                reward=s["reward"],
                sample_id=f"g{g}-s{i}",
                group_id=f"g{g}",
                created_at=0.0,
                finish_reason="stop" if c and c[-1] == trl["eos_id"] else "length",
            ).validate()
        )
    return out


def our_step(a, model: Path, trl: dict) -> dict:
    """Our trainer's step on TRL's batch: loss, grad norm (and the clip), HF-named gradients
    and weights."""
    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.checkpoint.export import iter_hf_tensors
    from areal_mega.common.malloc import set_training_policy
    from areal_mega.config import load_config
    from areal_mega.engine import MegatronEngine
    from bench.engine import load_hf_weights
    from bench.grpo_step import grpo_step

    set_training_policy()  # the trainer's malloc policy on CPU
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="vs_trl_step_") as run_dir:
        cfg = load_config(
            ROOT / "recipes" / "tiny-cpu.yaml",
            [
                "model_hparams=null",
                f"model.path={model}",
                f"logging.run_dir={run_dir}",
                f"rollout.batch_size={a.prompts}",
                f"rollout.n_samples={a.group}",
                f"rollout.max_new_tokens={a.max_new}",
                f"optimizer.lr={a.lr}",
                "optimizer.warmup_steps=0",
                "optimizer.clip_grad=1.0",
                "algorithm.kl_coef=0.0",
                "actor.temperature=1.0",
                f"seed={a.seed}",
            ],
        )
    mesh = _single_process_mesh()
    actor = MegatronEngine(
        cfg.model,
        role="actor",
        mesh=mesh,
        optimizer_cfg=cfg.optimizer,
        actor_cfg=cfg.actor,
        seed=cfg.seed,
        total_train_steps=1,
    )
    load_hf_weights(actor, model)
    chunks = actor.model_chunks()
    grads = {}

    def keep_grads():  # the gradient, exported as the weights are
        params = [p for c in chunks for p in c.parameters()]
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.copy_(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
            grads.update({n: t.clone() for n, t in iter_hf_tensors(chunks, actor.arch)})
            for p, s in zip(params, saved):
                p.copy_(s)

    stats = grpo_step(actor, mesh, cfg, trajectories(trl), 0, before_optimizer=keep_grads)
    after = {n: t.clone() for n, t in iter_hf_tensors(chunks, actor.arch)}
    mesh.destroy(process_group=True)
    return {
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "grads": grads,
        "after": after,
        "max_grad_norm": cfg.optimizer.clip_grad,
    }


EMBED = "model.embed_tokens.weight"


def without_pad_row(name: str, t, pad_id):
    """``t`` as fp64, without the embedding's row ``pad_id`` (HF's
    ``nn.Embedding(padding_idx=pad)`` gives it no gradient from lookups, Megatron's embedding
    does: the one place the models differ, when a sample holds pad)."""
    t = t.double()
    if name == EMBED and pad_id is not None:
        t = t[torch.arange(t.shape[0]) != pad_id]
    return t


def clip_factor(grad_norm: float, max_norm: float) -> float:
    """What torch's ``clip_grad_norm_`` and Megatron multiply the gradients by."""
    return min(1.0, max_norm / (grad_norm + 1e-6))


def rel_diffs(ours: dict, theirs: dict, pad_id=None) -> dict:
    """``|ours - theirs| / |theirs|`` per tensor name (tensors both have; a zero reference
    compares the absolute difference), the embedding's ``pad_id`` row left out
    (:func:`without_pad_row`)."""
    out = {}
    for name, t in theirs.items():
        ref, mine = without_pad_row(name, t, pad_id), without_pad_row(name, ours[name], pad_id)
        d = (mine - ref).norm().item()
        n = ref.norm().item()
        out[name] = d / n if n > 0 else d
    return out


def adamw_first_step(
    grads: dict, grad_norm: float, lr: float, max_norm: float, eps: float = 1e-8
) -> dict:
    """The update AdamW's first step makes from ``grads`` (no weight decay): the gradient
    clipped to ``max_norm`` (factor ``max_norm / (grad_norm + 1e-6)`` when below 1, as torch
    and Megatron clip), then ``-lr * g / (|g| + eps)`` (bias-corrected m = g, v = g^2). Two
    gradients equal to 1e-3 still give updates that differ wherever an element is ~0 (its sign
    is noise, the step ~ lr * sign), so each side's update is checked against this of its own
    gradient, and the gradients against each other."""
    clip = clip_factor(grad_norm, max_norm)
    return {
        n: -lr * (g.double() * clip) / ((g.double() * clip).abs() + eps) for n, g in grads.items()
    }


def norm_without_pad(grads: dict, pad_id) -> float:
    """The global norm of ``grads`` with the embedding's pad row left out."""
    return sum(float((without_pad_row(n, g, pad_id) ** 2).sum()) for n, g in grads.items()) ** 0.5


def summarise(values: dict, worst=max) -> dict:
    """The worst value (``max`` or ``min``), its tensor, and the median over tensors."""
    name = worst(values, key=values.get)
    return {
        "worst": values[name],
        "tensor": name,
        "median": statistics.median(values.values()),
        "tensors": len(values),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--from",
        dest="source",
        default=None,
        help="a bench/vs_trl/run.py --out: its "
        "SFT'd model (sft/hf_model) or else its model, and its data/train.jsonl",
    )
    p.add_argument(
        "--shape",
        choices=("135m", "tiny"),
        default="tiny",
        help="without --from: the model built here",
    )
    p.add_argument("--layers", type=int, default=2, help="without --from")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--out", default=None, help="default: runs/vs-trl-step-<pid>")
    a = p.parse_args(argv)
    require_trl_env()
    out = Path(a.out or ROOT / "runs" / f"vs-trl-step-{os.getpid()}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.source:
        src = Path(a.source)
        model = src / "sft" / "hf_model" if (src / "sft" / "hf_model").exists() else src / "model"
        train = src / "data" / "train.jsonl"
    else:
        model, data = make_assets(out, a.layers, a.seed, 0, a.shape)
        train = data / "train.jsonl"
    print(f"[vs_trl_step] model {model}; TRL's step (log {out / 'trl.log'})", flush=True)
    trl = run_trl_step(a, model, train, out / "trl")
    print("[vs_trl_step] our step on TRL's batch", flush=True)
    ours = our_step(a, model, trl)
    from safetensors.torch import save_file

    save_file(
        {n: t.contiguous() for n, t in ours["grads"].items()}, str(out / "ours_grads.safetensors")
    )

    from safetensors.torch import load_file

    from areal_mega.algo.advantages import group_normalize

    rewards = torch.tensor([s["reward"] for s in trl["samples"]])
    groups = torch.arange(len(rewards)) // trl["group"]
    adv_ours = group_normalize(rewards, groups)
    adv_trl = torch.tensor([s["advantage"] for s in trl["samples"]])
    pad = trl["pad_id"]
    clip = clip_factor(trl["grad_norm"], trl["max_grad_norm"])
    before = load_file(str(next(Path(model).glob("*.safetensors"))))
    trl_after = load_file(str(out / "trl" / "after.safetensors"))
    trl_unclipped = {
        n: g / clip for n, g in load_file(str(out / "trl" / "grads.safetensors")).items()
    }
    trl_grads = {n: g for n, g in trl_unclipped.items() if n in ours["grads"]}  # tied lm_head
    ours_step = {n: t - before[n] for n, t in ours["after"].items()}
    trl_step = {n: t - before[n] for n, t in trl_after.items()}
    res = {
        "model": str(model),
        "versions": trl["versions"],
        "loss_type": trl["loss_type"],
        "batch": {
            "samples": len(rewards),
            "completion_tokens": sum(len(s["completion_ids"]) for s in trl["samples"]),
            "reward_mean": float(rewards.mean()),
        },
        "loss": {"ours": ours["loss"], "trl": trl["loss"]},
        "grad_norm": {"ours": ours["grad_norm"], "trl": trl["grad_norm"]},
        "advantage_max_abs_diff": float((adv_ours - adv_trl).abs().max()),
        "pad_tokens_in_batch": sum(
            (s["prompt_ids"] + s["completion_ids"]).count(pad) for s in trl["samples"]
        ),
        "grad": summarise(rel_diffs(ours["grads"], trl_grads, pad_id=pad)),
        "update_vs_adamw": {
            "ours": summarise(
                rel_diffs(
                    ours_step,
                    adamw_first_step(ours["grads"], ours["grad_norm"], a.lr, ours["max_grad_norm"]),
                )
            ),
            "trl": summarise(
                rel_diffs(
                    trl_step,
                    adamw_first_step(trl_unclipped, trl["grad_norm"], a.lr, trl["max_grad_norm"]),
                )
            ),
        },
    }
    res["grad_norm_without_pad_row"] = {
        "ours": norm_without_pad(ours["grads"], pad),
        "trl": norm_without_pad(trl_grads, pad),
    }
    gn = res["grad_norm_without_pad_row"]
    res["agree"] = (
        res["grad"]["worst"] <= a.tol
        and abs(gn["ours"] / gn["trl"] - 1) <= a.tol
        and all(u["worst"] <= a.tol for u in res["update_vs_adamw"].values())
    )
    (out / "step.json").write_text(json.dumps(res, indent=2))
    b = res["batch"]
    print(
        f"\n{trl['versions']}; loss_type {trl['loss_type']}, scale_rewards "
        f"{trl['scale_rewards']}; batch {b['samples']} samples, {b['completion_tokens']} "
        f"completion tokens, mean reward {b['reward_mean']:.3f}"
    )
    print(f"{'':26s}{'ours':>12s}{'TRL':>14s}")
    for k in ("loss", "grad_norm", "grad_norm_without_pad_row"):
        print(f"{k:26s}{res[k]['ours']:12.6f}{res[k]['trl']:14.6f}")
    print(f"advantages: max |ours - TRL| = {res['advantage_max_abs_diff']:.2e}")
    if res["pad_tokens_in_batch"]:
        print(
            f"{res['pad_tokens_in_batch']} sampled pad tokens (id {pad}): the embedding's "
            f"pad row is left out (HF's padding_idx gives it no lookup gradient)"
        )
    s = res["grad"]
    print(
        f"gradient |ours - TRL| / |TRL| over {s['tensors']} tensors: largest "
        f"{s['worst']:.2e} ({s['tensor']}), median {s['median']:.2e}"
    )
    for side, u in res["update_vs_adamw"].items():
        print(
            f"update of {side:4s} against AdamW's first step on its own gradient: largest "
            f"{u['worst']:.2e} ({u['tensor']}), median {u['median']:.2e}"
        )
    print(
        f"\nsame step within {a.tol:g}: {'YES' if res['agree'] else 'NO'}  "
        f"(written: {out / 'step.json'})"
    )
    if not res["agree"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
