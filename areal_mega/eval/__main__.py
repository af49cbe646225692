"""Evaluate a model on prompt files: pass@k, per-source breakdown, response length, truncation.

    python -m areal_mega.eval --model HF_DIR --data test.jsonl [more.jsonl ...] \\
        --n-samples 8 --temperature 0.6 --max-new-tokens 1024 \\
        --reward-fn areal_mega.rewards:math_reward --out results.json

``--checkpoint DIR`` instead of ``--model``: a checkpoint of ours (a checkpoint root, one
``iter_*`` directory, written at any TP/PP/EP layout) is converted to an HF directory first; an
HF directory (e.g. ``<run_dir>/weights/vN`` or an exported ``hf_model``) is used as it is.

Servers: ``--server-addrs host:port ...`` uses running SGLang-compatible servers (they serve
the weights they hold; the model directory then only gives the tokenizer); without it,
``--num-servers`` CPU rollout servers (:mod:`areal_mega.inference.server`) are started for
the run and stopped at the end.

Prompts with images (vision-language models; the record formats of
:mod:`areal_mega.data.images`, e.g. ``python -m areal_mega.data.synthetic_vision``) are
tokenized with the model's image processor (``--min-pixels`` / ``--max-pixels`` bound the image
sizes, ``--on-bad-image`` stops on or skips a record with a bad image) and sent to the servers
with their images.

Temperature 0 is greedy decoding (deterministic). pass@1 is the fraction of correct samples
averaged over prompts; pass@k (k = 1, 2, 4, ..., n) is the unbiased estimator of Chen et al.
(2021); a sample is correct when its reward is >= ``--pass-threshold``. The summary is printed
and written with every completion to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from areal_mega.backends.clients import client_class
from areal_mega.common.files import atomic_write
from areal_mega.data.dataset import load_tokenizer
from areal_mega.data.images import BAD_IMAGE_ACTIONS, ImagePolicy
from areal_mega.data.vision_prompts import VisionPrompts
from areal_mega.eval.runner import evaluate, load_eval_items
from areal_mega.eval.scores import format_table, summarize
from areal_mega.inference.process import launch_local_servers
from areal_mega.rewards import load_reward_fn, shutdown_reward_workers


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is an HF model directory (config.json and safetensors weights)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model_dir(args, workdir: Path) -> Path:
    """The HF directory to serve and tokenize with: ``--model``, or ``--checkpoint`` as it is
    when it is an HF directory, else converted into ``workdir`` (only the tokenizer is needed
    with ``--server-addrs``: then a checkpoint's own ``hf/`` files or ``--hf-config``)."""
    from areal_mega.checkpoint.dist_ckpt import HF_SUBDIR, resolve_checkpoint

    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise ValueError(f"--model {model}: not an HF model directory (no config.json)")
        return model
    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise ValueError(f"--checkpoint {ckpt}: not a directory")
    if is_hf_dir(ckpt):
        return ckpt
    if args.server_addrs:  # the servers hold the weights: tokenizer files only
        hf = Path(args.hf_config) if args.hf_config else resolve_checkpoint(ckpt) / HF_SUBDIR
        if not (hf / "config.json").is_file():
            raise ValueError(
                f"--checkpoint {ckpt}: no HF config/tokenizer in {hf}; pass --hf-config"
            )
        return hf
    from areal_mega.checkpoint.convert import convert_mcore_to_hf
    from areal_mega.checkpoint.vl_convert import (
        checkpoint_config_dir,
        convert_vl_mcore_to_hf,
        is_vl_model_dir,
    )

    out = workdir / "hf"
    ckpt = resolve_checkpoint(ckpt)  # the latest iter_* of a root; a clear error if none
    print(f"[eval] converting checkpoint {ckpt} to HF format", file=sys.stderr)
    if is_vl_model_dir(checkpoint_config_dir(ckpt, args.hf_config)):  # with its image processor
        convert_vl_mcore_to_hf(ckpt, out, hf_config_dir=args.hf_config)
    else:
        convert_mcore_to_hf(ckpt, out, hf_config_dir=args.hf_config, progress=False)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m areal_mega.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory")
    src.add_argument("--checkpoint", help="our checkpoint (root or iter_* dir), or HF dir")
    p.add_argument("--hf-config", help="config/tokenizer dir for a checkpoint without hf/")
    p.add_argument("--data", nargs="+", required=True, help="JSONL / parquet prompt files")
    p.add_argument("--n-samples", type=int, default=1, help="samples per prompt (K)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=None, help="per-sample sampling seeds")
    p.add_argument(
        "--reward-fn",
        default="areal_mega.rewards:math_reward",
        help="module:function(prompt, completion, answer, **kw) -> float",
    )
    p.add_argument(
        "--pass-threshold",
        type=float,
        default=1.0,
        help="a sample is correct when its reward >= this",
    )
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--answer-key", default="answer")
    p.add_argument(
        "--chat-template",
        choices=["auto", "on", "off"],
        default="auto",
        help="auto: apply the tokenizer's chat template when it has one",
    )
    p.add_argument("--max-prompt-len", type=int, default=4096)
    p.add_argument(
        "--min-pixels", type=int, default=0, help="smallest image area; 0 = the processor's own"
    )
    p.add_argument(
        "--max-pixels", type=int, default=0, help="largest image area; 0 = the processor's own"
    )
    p.add_argument(
        "--on-bad-image",
        choices=list(BAD_IMAGE_ACTIONS),
        default="error",
        help="a record with a bad image: stop, or skip it (counted)",
    )
    p.add_argument("--images-key", default="images", help="record field of <image> images")
    p.add_argument(
        "--server-addrs",
        nargs="+",
        default=None,
        help="running SGLang-compatible servers host:port (default: start ours)",
    )
    p.add_argument(
        "--backend",
        choices=["sglang", "vllm"],
        default="sglang",
        help="what the --server-addrs speak (vllm: vLLM servers in dev mode)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("AREAL_ROLLOUT_API_KEY"),
        help="servers' API key (default: $AREAL_ROLLOUT_API_KEY)",
    )
    p.add_argument("--num-servers", type=int, default=1, help="local CPU servers to start")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--max-concurrent", type=int, default=64, help="requests in flight")
    p.add_argument("--out", default="eval_results.json", help="results JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name, lo in (
        ("n_samples", 1),
        ("max_new_tokens", 1),
        ("num_servers", 1),
        ("server_threads", 1),
        ("max_concurrent", 1),
        ("max_prompt_len", 1),
        ("min_pixels", 0),
        ("max_pixels", 0),
    ):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= {lo}")
    if args.min_pixels and args.max_pixels and args.min_pixels > args.max_pixels:
        p.error(f"--min-pixels={args.min_pixels}: must be <= --max-pixels ({args.max_pixels})")
    if args.temperature < 0:
        p.error(f"--temperature={args.temperature}: must be >= 0")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p={args.top_p}: must be in (0, 1]")
    return args


async def _run(args, addrs: list, items: list, tokenizer, reward_fn) -> list:
    client = client_class(args.backend)(addrs, api_key=args.api_key)
    try:
        await client.wait_ready(timeout=120.0)
        return await evaluate(
            client,
            items,
            tokenizer,
            reward_fn,
            n_samples=args.n_samples,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            max_concurrent=args.max_concurrent,
            seed=args.seed,
            progress=not args.no_progress,
        )
    finally:
        await client.close()


def main(argv=None) -> dict:
    """Run the evaluation described by ``argv``; prints the table, writes ``--out`` and
    returns the written results (``summary``, ``settings``, ``records``)."""

    args = parse_args(argv)
    reward_fn = load_reward_fn(args.reward_fn)
    workdir = Path(tempfile.mkdtemp(prefix="areal-eval-"))
    procs = []
    try:
        model_dir = resolve_model_dir(args, workdir)
        tokenizer = load_tokenizer(str(model_dir))
        chat = {"on": True, "off": False}.get(
            args.chat_template, bool(getattr(tokenizer, "chat_template", None))
        )
        items = load_eval_items(
            args.data,
            tokenizer,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            apply_chat_template=chat,
            max_prompt_len=args.max_prompt_len,
            vision=VisionPrompts(
                str(model_dir),
                min_pixels=args.min_pixels,
                max_pixels=args.max_pixels,
                policy=ImagePolicy(on_bad=args.on_bad_image),
                images_key=args.images_key,
            ),
        )
        addrs = args.server_addrs
        if not addrs:
            procs = launch_local_servers(
                str(model_dir),
                args.num_servers,
                api_key=args.api_key,
                num_threads=args.server_threads,
            )
            addrs = [p.addr for p in procs]
        t0 = time.time()
        records = asyncio.run(_run(args, addrs, items, tokenizer, reward_fn))
        seconds = time.time() - t0
    finally:
        for proc in procs:
            proc.stop()
        shutdown_reward_workers()
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(records, pass_threshold=args.pass_threshold)
    settings = {
        k: getattr(args, k)
        for k in (
            "model",
            "checkpoint",
            "data",
            "n_samples",
            "temperature",
            "top_p",
            "top_k",
            "max_new_tokens",
            "seed",
            "reward_fn",
            "pass_threshold",
            "server_addrs",
            "min_pixels",
            "max_pixels",
            "on_bad_image",
        )
    }
    settings["chat_template"] = chat
    result = {"summary": summary, "settings": settings, "seconds": seconds, "records": records}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # not durable: nothing reads it back on recovery; a lost file is one rerun
    atomic_write(out, json.dumps(result, indent=1) + "\n", durable=False)
    print(format_table(summary))
    print(
        f"[eval] {len(records)} prompts x {args.n_samples} samples in {seconds:.1f} s; "
        f"results: {out}"
    )
    return result


def cli(argv=None) -> None:
    """Entry point: :func:`main`, with bad input (a missing file, a record without the prompt
    field, a bad reward path or checkpoint) reported as one line and exit code 2."""
    from areal_mega.checkpoint.dist_ckpt import CheckpointError

    try:
        main(argv)
    except (ValueError, CheckpointError, FileExistsError) as e:  # DataError is a ValueError
        print(f"[eval] error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
