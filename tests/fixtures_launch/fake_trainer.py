"""Stand-in for ``areal_mega.trainer`` in launcher tests (run under torchrun).

Checks that the resolved config names the launched servers and that they answer, then:
first launch: writes a complete checkpoint ``iter_0000003`` (``areal_meta.json``) and crashes;
relaunch (recover=auto): finds it, as the real trainer does, and exits 0.
"""

import os
import sys
import time
import urllib.request

from areal_mega.config import load_config


def main():
    args = sys.argv[1:]
    overrides = dict(a.split("=", 1) for a in args if "=" in a)
    if os.environ.get("FAKE_TRAINER_MODE") == "echo":  # print what torchrun handed over
        pid_dir = os.environ.get("FAKE_PID_DIR")
        for _ in range(400):  # live until a rollout worker (if one is expected) is up
            if not pid_dir or os.path.exists(os.path.join(pid_dir, "worker.pid")):
                break
            time.sleep(0.05)
        line = (
            f"ECHO rank={os.environ.get('RANK')} world={os.environ.get('WORLD_SIZE')} args={args}"
        )
        print(line, flush=True)
        if pid_dir:  # one file per rank: lines of ranks sharing a pipe can interleave
            with open(os.path.join(pid_dir, f"echo-rank{os.environ.get('RANK')}.txt"), "w") as f:
                f.write(line + "\n")
        return
    # the real config code: launch.local hands over a resolved file, torchrun.sh the recipe
    # plus key=value overrides
    cfg = load_config(
        args[args.index("--config") + 1], [a for a in args if "=" in a and not a.startswith("-")]
    )
    addrs = cfg.rollout.server_addrs
    assert addrs, "no rollout servers in the resolved config"
    for addr in addrs:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
            assert r.status == 200
    ckpt = os.path.join(cfg.logging.run_dir, "checkpoints")
    rank = os.environ.get("RANK", "?")
    print(
        f"rank {rank} world {os.environ.get('WORLD_SIZE')} servers {addrs} overrides {overrides}",
        flush=True,
    )
    done = os.path.join(ckpt, "iter_0000003", "areal_meta.json")
    if not os.path.exists(done):  # first launch: save a checkpoint, then crash
        if rank == "0":
            os.makedirs(os.path.dirname(done), exist_ok=True)
            os.makedirs(os.path.join(ckpt, "iter_0000005.tmp"), exist_ok=True)  # incomplete
            open(done, "w").write('{"complete": true}')
        else:  # the other ranks crash after the save, as a real trainer's do: torchrun stops
            for _ in range(600):  # every rank once one fails, rank 0's save included
                if os.path.exists(done):
                    break
                time.sleep(0.05)
        sys.exit(3)
    assert cfg.recover == "auto"  # relaunch: the trainer resumes by itself
    print("resumed OK from iter_0000003", flush=True)


if __name__ == "__main__":
    main()
