"""Generated tokens/s of the CPU rollout server against transformers' ``generate``, same batch.

    python bench/rollout.py [--concurrency 1 8 32] [--new-tokens 128] [--prompt-len 58]
                            [--threads 2] [--model-path DIR | --hidden 576 --layers 30 ...]

Without --model-path a Llama of the given shape (default: a 135M-parameter model, hidden 576,
30 layers, 9 heads, 3 KV heads, FFN 1536, vocabulary 49,152, tied embeddings) with random
weights is written to a temp dir. For each concurrency C:

* ours: the server runs as a real process (``--threads`` torch threads); C requests of
  ``--prompt-len`` tokens are sent at once over HTTP (logprobs returned), each asking for
  ``--new-tokens`` tokens with ``ignore_eos`` at temperature 1 (no top-k / top-p);
* transformers: ``model.generate`` in this process (same threads, server idle) on the same C
  prompts as one batch, sampling at temperature 1 with no top-k / top-p and
  ``min_new_tokens = max_new_tokens`` (no EOS stop).

Tokens/s = generated tokens / wall-clock seconds, prefill included, best of ``--repeats``
(the 2 cores may be shared: the minimum time is the least disturbed run); the two sides
alternate so that a busy spell hits both. Prints each side and the ratio ours / transformers.

``--prefix-groups G`` measures the prefix cache instead: the C requests are C / G GRPO groups
(G samples of one prompt each, every request sent on its own, as a rollout client does), and
the two sides are the server with its default prefix cache and one started with
``--prefix-cache-mb 0``. Prompt tokens forwarded per group come from each server's own
``/server_info`` counters (``prefill_tokens``); fresh prompts every repeat, so no repeat finds
the previous one's groups cached.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_mega.inference.process import launch_local_servers  # noqa: E402
from areal_mega.rollout.client import RolloutClient, sampling_dict  # noqa: E402


def write_model(path: str, args) -> str:
    """A Llama with random weights of the shape in ``args`` (no tokenizer: ids only)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def prompts_for(concurrency: int, args, seed: int = 0, group: int = 1) -> list:
    """``concurrency`` prompts of ``--prompt-len`` token ids: ``concurrency / group``
    distinct ones, each ``group`` times in a row."""
    import torch

    g = torch.Generator().manual_seed(concurrency + 1000 * seed)
    distinct = torch.randint(
        3,
        args.vocab if not args.model_path else 1000,
        (concurrency // group, args.prompt_len),
        generator=g,
    ).tolist()
    return [p for p in distinct for _ in range(group)]


def server_counters(addr: str) -> tuple:
    """The server's own counters so far: prompt tokens forwarded, seconds in prefill
    forwards, seconds in decode forwards, CPU seconds of the server process (all threads:
    what it computed, whatever else shares the cores)."""

    async def get():
        c = RolloutClient([addr], timeout_s=60)
        try:
            return await c.request(addr, "GET", "/server_info")
        finally:
            await c.close()

    info = asyncio.run(get())
    return (
        info["prefill_tokens"],
        info["forward_seconds"]["prefill"],
        info["forward_seconds"]["decode"],
        info["process_cpu_seconds"],
    )


def prefix_main(args, path: str) -> None:
    """``--prefix-groups``: the server with its prefix cache against ``--prefix-cache-mb 0``."""
    G = args.prefix_groups
    on, off = (
        launch_local_servers(path, 1, num_threads=args.threads, max_running=max(args.concurrency))[
            0
        ],
        launch_local_servers(
            path,
            1,
            num_threads=args.threads,
            max_running=max(args.concurrency),
            extra_args=["--prefix-cache-mb", "0"],
        )[0],
    )
    rows = []
    try:
        for srv in (on, off):
            asyncio.run(ours_once(srv.addr, prompts_for(1, args, seed=99), 4))
        for c in args.concurrency:
            if c % G:
                raise SystemExit(f"--concurrency {c}: not a multiple of --prefix-groups {G}")
            best = {"on": (float("inf"),), "off": (float("inf"),)}
            for rep_i in range(args.repeats):
                prompts = prompts_for(c, args, seed=rep_i + 1, group=G)
                for name, srv in (("off", off), ("on", on)):
                    before = server_counters(srv.addr)
                    dt = asyncio.run(ours_once(srv.addr, prompts, args.new_tokens))
                    tok, pre_s, dec_s, cpu_s = (
                        b - a for a, b in zip(before, server_counters(srv.addr))
                    )
                    best[name] = min(best[name], (dt, tok / (c // G), pre_s, dec_s, cpu_s))
                    print(
                        f"    repeat {rep_i} {name:3s}: {dt:6.1f} s (prefill forwards "
                        f"{pre_s:.1f} s, decode forwards {dec_s:.1f} s; server CPU "
                        f"{cpu_s:.1f} s)",
                        flush=True,
                    )
            n = c * args.new_tokens
            (t_on, p_on, *_, cpu_on), (t_off, p_off, *_, cpu_off) = best["on"], best["off"]
            rows.append((c, n / t_on, n / t_off, p_on, p_off))
            print(
                f"  {c:3d} concurrent: server CPU seconds per token with / without the cache "
                f"= {cpu_on / cpu_off:5.2f}x (best repeats)",
                flush=True,
            )
            print(
                f"  {c:3d} concurrent ({c // G} groups of {G}): cache {n / t_on:8.1f} tok/s, "
                f"{p_on:7.0f} prefill tokens/group   no cache {n / t_off:8.1f} tok/s, "
                f"{p_off:7.0f} prefill tokens/group",
                flush=True,
            )
    finally:
        on.stop()
        off.stop()
    for c, ton, toff, pon, poff in rows:
        print(
            f"{c:3d} concurrent requests: prefill tokens per group {poff:.0f} -> {pon:.0f} "
            f"({poff / max(pon, 1):.2f}x fewer, goal >= 6x); tokens/s with / without the "
            f"cache = {ton / toff:5.2f}x"
        )


async def ours_once(addr: str, prompts: list, new_tokens: int) -> float:
    """Seconds for the server to answer all ``prompts`` sent at once."""
    c = RolloutClient([addr], timeout_s=3600)
    try:
        params = sampling_dict(new_tokens, 1.0, ignore_eos=True)
        t0 = time.perf_counter()
        res = await asyncio.gather(*[c.generate(p, params) for p in prompts])
        dt = time.perf_counter() - t0
        assert all(len(r.output_ids) == new_tokens for r in res), "short answer"
        return dt
    finally:
        await c.close()


def hf_once(model, prompts: list, new_tokens: int) -> float:
    """Seconds for ``model.generate`` on ``prompts`` as one batch."""
    import torch

    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=58)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--prefix-groups",
        type=int,
        default=0,
        help="measure the prefix cache on GRPO groups of this many samples "
        "(the server with and without its cache, no transformers side)",
    )
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or write_model(os.path.join(tmp, "m"), args)
        if args.prefix_groups:
            prefix_main(args, path)
            print(
                f"prompts {args.prompt_len} tokens, {args.new_tokens} new tokens, "
                f"{args.threads} threads, torch {torch.__version__}"
            )
            return
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        srv = launch_local_servers(
            path, 1, num_threads=args.threads, max_running=max(args.concurrency)
        )[0]
        rows = []
        try:
            warm = prompts_for(1, args)
            asyncio.run(ours_once(srv.addr, warm, 4))
            hf_once(model, warm, 4)
            for c in args.concurrency:
                prompts = prompts_for(c, args)
                t_ours, t_hf = float("inf"), float("inf")
                for _ in range(args.repeats):
                    t_hf = min(t_hf, hf_once(model, prompts, args.new_tokens))
                    t_ours = min(t_ours, asyncio.run(ours_once(srv.addr, prompts, args.new_tokens)))
                n = c * args.new_tokens
                rows.append((c, n / t_ours, n / t_hf))
                print(
                    f"  {c:3d} concurrent: ours {n / t_ours:8.1f} tok/s   transformers "
                    f"{n / t_hf:8.1f} tok/s   ratio {t_hf / t_ours:5.2f}x",
                    flush=True,
                )
        finally:
            srv.stop()
    shape = (
        f"{args.model_path}"
        if args.model_path
        else f"llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"{args.kv_heads} KV heads, FFN {args.ffn}, vocab {args.vocab}"
    )
    print(
        f"model: {shape}; prompts {args.prompt_len} tokens, {args.new_tokens} new tokens, "
        f"{args.threads} threads, torch {torch.__version__}"
    )
    for c, ours, hf in rows:
        goal = "  (goal >= 2x)" if c >= 8 else ""
        print(f"{c:3d} concurrent requests: ours / transformers generate = {ours / hf:5.2f}x{goal}")


if __name__ == "__main__":
    main()
