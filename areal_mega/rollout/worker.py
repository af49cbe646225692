"""The rollout worker process: a :class:`RolloutController` fed from the prompt dataset, finished
groups sent over the data plane, weight updates commanded by the trainer on the control channel.

    python -m areal_mega.rollout.worker --config RUN_DIR/config.yaml [key=value ...]

``rollout.server_addrs`` must list the running servers (the launcher fills it in).
Control commands (see :mod:`areal_mega.rollout.control`): ``update_weights {version, path}``,
``stats``, ``ping``.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Iterator

log = logging.getLogger("areal_mega.rollout.worker")


def prompt_stream(dataset, seed: int, shuffle: bool = True, start_epoch: int = 0) -> Iterator:
    """Endless prompt items (dicts for the workflows), epoch after epoch."""
    from areal_mega.data.dataset import epoch_permutation

    epoch = start_epoch
    while True:
        for i in epoch_permutation(len(dataset.items), seed, epoch, shuffle):
            it = dataset.items[int(i)]
            yield {"input_ids": it.input_ids, "prompt": it.prompt, "answer": it.answer,
                   "index": it.index, **it.meta}
        epoch += 1


def build_controller(cfg, sink, tokenizer=None, prompts=None, initial_version: int = 0):
    """A controller wired from an ``ExperimentConfig`` (servers, workflow, reward, sampling)."""
    from areal_mega.rollout.client import RolloutClient
    from areal_mega.rollout.controller import RolloutController
    from areal_mega.rollout.workflows import workflow_from_config

    r = cfg.rollout
    if not r.server_addrs:
        raise ValueError("rollout.server_addrs is empty: start the servers first")
    client = RolloutClient(r.server_addrs, api_key=r.api_key, timeout_s=r.request_timeout_s,
                           retries=r.request_retries)
    return RolloutController(client, workflow_from_config(r), prompts, batch_size=r.batch_size,
                             n_samples=r.n_samples, eta=r.max_head_offpolicyness,
                             max_concurrent=r.max_concurrent, temperature=r.temperature,
                             top_p=r.top_p, top_k=r.top_k, tokenizer=tokenizer, sink=sink,
                             initial_version=initial_version)


def main(argv=None) -> None:
    """CLI entry point; runs until SIGTERM/SIGINT."""
    from transformers import AutoTokenizer

    from areal_mega.config import load_config
    from areal_mega.data.dataset import PromptDataset
    from areal_mega.dataplane import TrajectorySender
    from areal_mega.rollout.control import ControlServer
    from areal_mega.rollout.controller import dataplane_sink
    from areal_mega.train.session import control_endpoint, data_endpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--initial-version", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = load_config(args.config, args.overrides)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    ds = PromptDataset.from_config(cfg.data, tok)
    sender = TrajectorySender(data_endpoint(cfg), secret=cfg.dataplane.secret)
    ctl = build_controller(cfg, dataplane_sink(sender), tok,
                           prompt_stream(ds, cfg.seed, cfg.data.shuffle),
                           initial_version=args.initial_version)

    def handle(msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "update_weights":
            ctl.update_weights(int(msg["version"]), path=str(msg["path"]))
            return {"version": ctl.version}
        if cmd == "stats":
            return ctl.stats()
        if cmd == "ping":
            return {}
        raise ValueError(f"unknown cmd {cmd!r}; known: update_weights, stats, ping")

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    control = ControlServer(control_endpoint(cfg), handle).start()
    ctl.start()
    log.info("rollout worker up: %d servers, control %s", len(cfg.rollout.server_addrs),
             control.endpoint)
    try:
        done.wait()
    finally:
        control.close()
        ctl.stop()
        sender.close()


if __name__ == "__main__":
    main()
