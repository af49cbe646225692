"""bench/vs_trl/run.py's held-out evaluations: several weight directories of one model, each
scored by our evaluation CLI (:func:`areal_mega.eval.__main__.main` with ``--server-addrs``)
on one CPU rollout server of ours, which loads each directory in turn like a disk weight update
in training (``POST /update_weights_from_disk``): one server start for all of them.

    python -m bench.vs_trl.evaluate --out DIR --threads N --models NAME=DIR [NAME=DIR ...] \\
        -- --data test.jsonl --temperature 0 ...   # the rest: the evaluation CLI's options

Writes ``DIR/NAME.json`` (the CLI's results) for each; the first directory is the one the server
starts with (its tokenizer is every evaluation's: the directories are one model's weights)."""

import argparse
import json
import sys
import urllib.request
from pathlib import Path


def load_weights(addr: str, model_dir: str, timeout: float = 600.0) -> None:
    """Make the server at ``addr`` serve the HF weights of ``model_dir``."""
    req = urllib.request.Request(
        f"http://{addr}/update_weights_from_disk",
        data=json.dumps({"model_path": model_dir}).encode(),
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    reply = json.loads(opener.open(req, timeout=timeout).read())
    if not reply.get("success"):
        raise SystemExit(f"loading {model_dir} failed: {reply}")


def main(argv=None) -> None:
    """Evaluate every ``--models`` directory (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :])
        if "--" in argv
        else (
            argv,
            [],
        )
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--models", nargs="+", required=True, help="NAME=DIR, in order")
    a = p.parse_args(ours)
    from areal_mega.eval.__main__ import main as evaluate
    from areal_mega.inference.process import launch_local_servers

    models = [m.split("=", 1) for m in a.models]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (server,) = launch_local_servers(models[0][1], 1, num_threads=a.threads)
    try:
        for i, (name, model_dir) in enumerate(models):
            if i:
                load_weights(server.addr, model_dir)
            evaluate(
                [
                    "--model",
                    model_dir,
                    "--server-addrs",
                    server.addr,
                    "--out",
                    str(out / f"{name}.json"),
                    "--no-progress",
                    *rest,
                ]
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
