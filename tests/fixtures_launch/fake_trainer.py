"""Stand-in for ``areal_mega.trainer`` in launcher tests (run under torchrun).

Checks that the resolved config names the launched servers and that they answer, then:
first launch (no ``checkpoint.load`` override): writes a complete checkpoint ``step_3`` and
crashes; relaunch: checks it was pointed at ``step_3`` and exits 0.
"""
import os
import sys
import urllib.request

import yaml


def main():
    args = sys.argv[1:]
    overrides = dict(a.split("=", 1) for a in args if "=" in a)
    if os.environ.get("FAKE_TRAINER_MODE") == "echo":  # print what torchrun handed over
        print(f"ECHO rank={os.environ.get('RANK')} world={os.environ.get('WORLD_SIZE')} "
              f"args={args}", flush=True)
        return
    cfg = yaml.safe_load(open(args[args.index("--config") + 1]))
    addrs = cfg["rollout"]["server_addrs"]
    assert addrs, "no rollout servers in the resolved config"
    for addr in addrs:
        with urllib.request.urlopen(f"http://{addr}/health_generate", timeout=5) as r:
            assert r.status == 200
    ckpt = os.path.join(cfg["logging"]["run_dir"], "checkpoints")
    rank = os.environ.get("RANK", "?")
    print(f"rank {rank} world {os.environ.get('WORLD_SIZE')} servers {addrs} "
          f"overrides {overrides}", flush=True)
    if "checkpoint.load" not in overrides:
        if rank == "0":
            os.makedirs(os.path.join(ckpt, "step_3"), exist_ok=True)
            open(os.path.join(ckpt, "step_3", "COMPLETE"), "w").close()
            os.makedirs(os.path.join(ckpt, "step_5"), exist_ok=True)  # incomplete
        sys.exit(3)
    assert overrides["checkpoint.load"].endswith("step_3"), overrides
    print("resumed OK", flush=True)


if __name__ == "__main__":
    main()
