"""Trainer-side throughput on CPU: our MegatronEngine against transformers eager, one run.

Usage: python bench/engine.py [--layers 30 --seqs 8 --mb-tokens 2048 --threads 2]

Model: the shape of a 135M Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536,
vocabulary 49,152, tied embeddings), random weights, fp32. The parent process writes one HF
checkpoint (``save_pretrained``); both sides load exactly those weights: transformers'
``LlamaForCausalLM`` (``attn_implementation="eager"``) with ``from_pretrained``, our engine
through the HF -> megatron tensor mapping of :mod:`areal_mega.checkpoint.hf_mapping`.

Batch: ``--seqs`` sequences of a prompt of 20-200 tokens and a completion of 1-500 tokens
(loss on the completion), cut greedily into micro-batches of at most ``--mb-tokens`` tokens.
Both sides get the same micro-batches: ours packed (one row, no padding), transformers'
right-padded to the longest sequence of the micro-batch with an attention mask (how HF-based
trainers batch). Tokens/s counts real tokens only.

* forward: per-token log-probabilities of the whole batch (ours: ``forward_logprobs``; HF:
  ``log_softmax(logits.float()).gather``), no grad;
* forward+backward: the summed NLL of the completion tokens, backward into the gradients
  (ours: ``forward_backward`` with the SFT loss; HF: ``loss.backward()``); no optimizer step.

Each side runs in its own subprocess with ``torch.set_num_threads(--threads)``: a warm-up on
the first micro-batch, then the best of ``--repeats`` full passes. Peak memory: the process's
resident-set high-water mark (Linux ``VmHWM``, reset before each measured phase; glibc told to
return freed large blocks to the OS) minus the RSS before the phase, and the absolute peak.
The logprobs of both sides are compared (max |difference| on the loss tokens) as a check that
both computed the same model.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
)


def make_batch(n_seqs, mb_tokens, vocab, seed):
    """``[[{input_ids, prompt_len}, ...], ...]``: sequences grouped into micro-batches."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n_seqs):
        p = int(torch.randint(20, 201, (1,), generator=g))
        c = int(torch.randint(1, 501, (1,), generator=g))
        seqs.append({"input_ids": torch.randint(3, vocab, (p + c,), generator=g), "prompt_len": p})
    groups, cur, used = [], [], 0
    for s in seqs:
        n = s["input_ids"].numel()
        if cur and used + n > mb_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    return groups + ([cur] if cur else [])


# ------------------------------------------------------------------------------- measuring
def _measure(fn, warmup, repeats):
    """(best wall seconds, peak extra bytes, absolute peak bytes, result, CPU seconds of the
    best pass) of ``fn()``."""
    from areal_mega.checkpoint.convert import peak_rss_bytes, reset_peak_rss, rss_bytes

    warmup()
    reset_peak_rss()
    before = rss_bytes()
    best, cpu, out = float("inf"), 0.0, None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = time.perf_counter() - t0
        if wall < best:
            best, cpu = wall, time.process_time() - c0
    peak = peak_rss_bytes()
    return best, max(peak - before, 0), peak, out, cpu


def load_hf_weights(eng, hf_dir):
    """Copy the single-file HF checkpoint in ``hf_dir`` (``model.safetensors``, or its one
    ``*.safetensors`` shard) into ``eng``'s (world-size-1) model through the HF -> megatron
    tensor mapping (tied embeddings: the output layer reads ``model.embed_tokens.weight``)."""
    import torch
    from safetensors import safe_open

    from areal_mega.checkpoint import hf_mapping as hm

    arch = eng.arch
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{hf_dir}: expected one *.safetensors file, found {len(files)}")
    with safe_open(str(files[0]), "pt") as f, torch.no_grad():
        for chunk in eng.model_chunks():
            for name, p in chunk.named_parameters():
                layer, expert, suffix = hm.parse_mcore_name(name)
                names, kind = hm.hf_names_for(arch, layer, expert, suffix)
                names = [n if n in f.keys() else "model.embed_tokens.weight" for n in names]
                p.copy_(
                    hm.to_mcore(
                        arch, kind, [f.get_tensor(n) for n in names], padded_vocab_size=p.shape[0]
                    )
                )


def _ours(hf_dir, groups):
    """Our engine: (forward, forward+backward) measurements and per-sequence logprobs."""
    import numpy as np

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine import MegatronEngine
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout
    from areal_mega.train.sft import sft_loss

    mesh = _single_process_mesh()
    eng = MegatronEngine(
        ModelConfig(dtype="fp32", path=str(hf_dir)),
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-5, clip_grad=0.0),
        use_distributed_optimizer=False,
    )
    load_hf_weights(eng, hf_dir)

    def sample(s):
        ids = s["input_ids"].numpy()
        mask = (np.arange(len(ids)) >= s["prompt_len"]).astype(np.uint8)
        return next_token_layout(ids, loss_mask=mask)  # labels + loss mask, shifted

    mbs = [pack_sequences([sample(s) for s in g]) for g in groups]
    fwd = _measure(
        lambda: eng.forward_logprobs(mbs), lambda: eng.forward_logprobs(mbs[:1]), REPEATS[0]
    )
    fb = _measure(
        lambda: eng.forward_backward(mbs, sft_loss),
        lambda: eng.forward_backward(mbs[:1], sft_loss),
        REPEATS[0],
    )
    lps = []
    for mb, lp in zip(mbs, fwd[3]):
        for b in range(len(mb["seqlens"])):
            s, n = int(mb["cu_seqlens"][b]), int(mb["seqlens"][b])
            lps.append(lp[s : s + n - 1].tolist())
    mesh.destroy(process_group=True)
    return fwd, fb, lps


def _hf(hf_dir, groups):
    """transformers eager on right-padded micro-batches."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(hf_dir), attn_implementation="eager", dtype=torch.float32
    )

    def padded(group):
        n = max(s["input_ids"].numel() for s in group)
        ids = torch.zeros(len(group), n, dtype=torch.long)
        mask = torch.zeros(len(group), n, dtype=torch.long)
        loss = torch.zeros(len(group), n - 1)
        for i, s in enumerate(group):
            m = s["input_ids"].numel()
            ids[i, :m], mask[i, :m] = s["input_ids"], 1
            loss[i, s["prompt_len"] - 1 : m - 1] = 1.0
        return ids, mask, loss

    batches = [padded(g) for g in groups]

    def logprobs(ids, mask):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    def forward(bs):
        model.eval()
        with torch.no_grad():
            return [logprobs(ids, mask) for ids, mask, _ in bs]

    def fwd_bwd(bs):
        model.train()
        model.zero_grad(set_to_none=True)
        for ids, mask, loss_mask in bs:
            (-(logprobs(ids, mask) * loss_mask).sum()).backward()

    fwd = _measure(lambda: forward(batches), lambda: forward(batches[:1]), REPEATS[0])
    fb = _measure(lambda: fwd_bwd(batches), lambda: fwd_bwd(batches[:1]), REPEATS[0])
    lps = [
        lp[i, : s["input_ids"].numel() - 1].tolist()
        for g, lp in zip(groups, fwd[3])
        for i, s in enumerate(g)
    ]
    return fwd, fb, lps


REPEATS = [1]


def child(side, hf_dir, args, out):
    import torch

    from areal_mega.common.malloc import set_training_policy

    set_training_policy()  # the trainer's malloc policy on CPU, for both sides
    torch.set_num_threads(args.threads)
    REPEATS[0] = args.repeats
    groups = make_batch(args.seqs, args.mb_tokens, SHAPE["vocab_size"], args.seed)
    fwd, fb, lps = (_ours if side == "ours" else _hf)(hf_dir, groups)
    res = {
        "fwd_s": fwd[0],
        "fwd_peak_extra": fwd[1],
        "fwd_peak": fwd[2],
        "fwd_cpu": fwd[4],
        "fb_s": fb[0],
        "fb_peak_extra": fb[1],
        "fb_peak": fb[2],
        "fb_cpu": fb[4],
        "lps": lps,
    }
    Path(out).write_text(json.dumps(res))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--mb-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs=3, metavar=("SIDE", "HF_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args, args.child[2])

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    groups = make_batch(args.seqs, args.mb_tokens, SHAPE["vocab_size"], args.seed)
    n_tokens = sum(s["input_ids"].numel() for g in groups for s in g)
    lens = [s["input_ids"].numel() for g in groups for s in g]
    print(
        f"model: 135M Llama shape, {args.layers} layers, fp32, {args.threads} threads; "
        f"batch: {args.seqs} sequences ({min(lens)}-{max(lens)} tokens, {n_tokens} in all) "
        f"in {len(groups)} micro-batches of <= {args.mb_tokens} tokens"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        torch.manual_seed(args.seed)
        cfg = LlamaConfig(**dict(SHAPE, num_hidden_layers=args.layers))
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        for side in ("hf", "ours"):
            out = Path(tmp) / f"{side}.json"
            cmd = [sys.executable, __file__, "--child", side, tmp, str(out)] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child",)
            ]
            env = dict(os.environ, PYTHONWARNINGS="ignore")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode or not out.exists():
                sys.exit(f"{side} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results[side] = json.loads(out.read_text())
    worst = max(
        abs(a - b)
        for x, y in zip(results["ours"]["lps"], results["hf"]["lps"])
        for a, b in zip(x, y)
    )
    mib = 1 << 20
    w = 28
    print(f"{'':{w}s}{'transformers eager':>20s}{'ours':>12s}{'ours/hf':>9s}")
    for key, name in (("fwd", "forward"), ("fb", "forward+backward")):
        h, o = results["hf"], results["ours"]
        rows = [
            (f"{name} tokens/s", n_tokens / h[f"{key}_s"], n_tokens / o[f"{key}_s"], 1),
            (
                "  tokens per CPU-second",
                n_tokens / max(h[f"{key}_cpu"], 1e-9),
                n_tokens / max(o[f"{key}_cpu"], 1e-9),
                1,
            ),
            (
                "  peak extra memory MiB",
                h[f"{key}_peak_extra"] / mib,
                o[f"{key}_peak_extra"] / mib,
                0,
            ),
            ("  peak RSS MiB", h[f"{key}_peak"] / mib, o[f"{key}_peak"] / mib, 0),
        ]
        for label, a, b, digits in rows:
            print(f"{label:{w}s}{a:20.{digits}f}{b:12.{digits}f}{b / max(a, 1e-9):8.2f}x")
    print(f"max |logprob ours - transformers| over all tokens: {worst:.2e}")


if __name__ == "__main__":
    sys.exit(main())
