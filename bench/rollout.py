"""Generated tokens/s of the CPU rollout server with 1 and 8 concurrent requests.

    python bench/rollout.py [--model-path DIR] [--new-tokens 64] [--hidden 128 --layers 2]

Without --model-path a tiny llama is built in a temp dir. The server runs as a real process
(1 torch thread); the numbers are wall-clock from the client side.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_mega.rollout.client import RolloutClient, sampling_dict  # noqa: E402
from areal_mega.rollout.launch import launch_local_servers  # noqa: E402


async def measure(addr: str, concurrency: int, new_tokens: int, rounds: int) -> float:
    c = RolloutClient([addr], timeout_s=600)
    try:
        await c.generate([5, 6, 7], sampling_dict(4, 1.0, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        total = 0
        for r in range(rounds):
            res = await asyncio.gather(*[
                c.generate([5 + i, 6, 7, 8 + r], sampling_dict(new_tokens, 1.0,
                                                              ignore_eos=True))
                for i in range(concurrency)])
            total += sum(len(x.output_ids) for x in res)
        return total / (time.perf_counter() - t0)
    finally:
        await c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path
        if path is None:
            from areal_mega.models.tiny import make_tiny_model
            path = str(make_tiny_model(os.path.join(tmp, "m"), hidden_size=args.hidden,
                                       num_layers=args.layers))
        srv = launch_local_servers(path, 1)[0]
        try:
            one = asyncio.run(measure(srv.addr, 1, args.new_tokens, args.rounds * 2))
            eight = asyncio.run(measure(srv.addr, 8, args.new_tokens, args.rounds))
        finally:
            srv.stop()
    print(f"model: {path if args.model_path else f'tiny llama hidden {args.hidden}, '}"
          f"{'' if args.model_path else f'{args.layers} layers'}; {args.new_tokens} new tokens")
    print(f"1 concurrent request : {one:8.1f} generated tokens/s")
    print(f"8 concurrent requests: {eight:8.1f} generated tokens/s "
          f"({eight / one:.1f}x of sequential)")


if __name__ == "__main__":
    main()
