"""Agents that areal-mega does not start, trained online through the rollout worker's gateway
(``rollout.workflow: online``), with the official ``openai`` package; their reward is posted
later by a separate process.

    python examples/online_agent/agent.py all --run-dir runs/online-agent \
        --data runs/online-agent/data/train.jsonl --agents 2 --group 4

starts ``--agents`` talking processes and one rewarding process (``talk`` / ``reward`` run one
of each). A talking process works on one task at a time with ``--group`` concurrent agents
(threads, one session each: the task's group). An agent reads the gateway's address and admin
key from ``<run_dir>/online_gateway.json`` (written by the rollout worker, mode 0600), opens a
session for a task (``POST /rl/start_session``; on 429/503 it waits ``Retry-After``), asks the
model with ``openai.OpenAI(base_url=..., api_key=<session key>)``, ends the session and writes
what it got to ``<log_dir>/talk-<i>.jsonl``. The rewarder reads those lines, waits ``--delay``
seconds (a test suite, a human rating...), scores the reply (the fraction of characters that
match the reversed digits of the tiny CPU task, or with ``--reward exact`` 1 for exactly the
answer) and posts ``/rl/set_reward``;
``<log_dir>/rewards.jsonl`` records each answer. Talking process ``a`` of ``A`` works on task
``j*A + a`` in its ``j``-th round.
"""

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def gateway(run_dir: Path) -> dict:
    """The gateway's base URL and admin key, once the rollout worker has written them."""
    while True:
        try:
            return json.loads((run_dir / "online_gateway.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.5)


def post(url: str, body: dict, key: str) -> tuple:
    """(status, JSON answer, Retry-After) of one POST."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers.get("Retry-After")


def char_match(text: str, want: str) -> float:
    """Fraction of positions where ``text`` matches ``want``, over the longer of the two."""
    if not text and not want:
        return 1.0
    return sum(a == b for a, b in zip(text, want)) / max(len(text), len(want))


def session(args, task: dict, k: int, log, lock) -> bool:
    """One agent's session on task ``k``: start, ask, end, log. False once the gateway has
    been unreachable for ``--give-up-s`` seconds (the run is over)."""
    from openai import OpenAI

    down_since = None
    while True:  # a session, once a group may start
        info = gateway(Path(args.run_dir))
        try:
            st, ans, wait = post(
                info["base_url"] + "/rl/start_session",
                {"task_id": f"task-{k}"},
                info["admin_api_key"],
            )
            down_since = None
        except OSError:  # the worker is restarting, or the run has ended
            st, wait = 0, "0.5"
            down_since = down_since or time.time()
            if time.time() - down_since > args.give_up_s:
                return False
        if st == 200:
            break
        time.sleep(float(wait or 1))
    rec = {
        "session_id": ans["session_id"],
        "sample_id": ans["sample_id"],
        "answer": str(task["answer"]),
    }
    try:
        client = OpenAI(
            base_url=ans["base_url"], api_key=ans["api_key"], max_retries=0, timeout=120
        )
        reply = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=args.max_tokens,
            temperature=1.0,
        )
        rec["reply"] = (reply.choices[0].message.content or "").strip()
        st, _, _ = post(
            info["base_url"] + "/rl/end_session", {"session_id": ans["session_id"]}, ans["api_key"]
        )
        rec["ended"] = st == 200
    except Exception as e:  # noqa: BLE001 - e.g. the worker was killed
        rec["error"] = repr(e)[:200]
    with lock:
        log.write(json.dumps(rec) + "\n")
        log.flush()
    return True


def talk(args) -> None:
    """Agent process ``args.agent``: ``args.group`` concurrent sessions (threads) of one task
    at a time, so that they form the task's group."""
    tasks = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
    log = open(Path(args.log_dir) / f"talk-{args.agent}.jsonl", "a")
    lock = threading.Lock()
    for j in range(args.sessions):
        k = (j * args.agents + args.agent) % len(tasks)
        alive = []
        threads = [
            threading.Thread(
                target=lambda alive=alive, k=k: alive.append(session(args, tasks[k], k, log, lock))
            )
            for _ in range(args.group)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(alive):
            return


def reward(args) -> None:
    logs = Path(args.log_dir)
    out = open(logs / "rewards.jsonl", "a")
    offsets: dict = {}
    pending: list = []  # (due time, record)
    while True:
        for f in sorted(logs.glob("talk-*.jsonl")):
            with open(f) as fh:
                fh.seek(offsets.get(f, 0))
                for line in iter(fh.readline, ""):
                    if not line.endswith("\n"):
                        break
                    offsets[f] = fh.tell()
                    rec = json.loads(line)
                    if rec.get("ended"):
                        pending.append((time.time() + args.delay, rec))
        now = time.time()
        for due, rec in [p for p in pending if p[0] <= now]:
            pending.remove((due, rec))
            r = (
                float(rec["reply"] == rec["answer"])
                if args.reward == "exact"
                else char_match(rec["reply"], rec["answer"])
            )
            info = gateway(Path(args.run_dir))
            try:
                st, ans, _ = post(
                    info["base_url"] + "/rl/set_reward",
                    {"session_id": rec["session_id"], "reward": r},
                    info["admin_api_key"],
                )
            except OSError as e:  # the worker is restarting: the session is journaled,
                st, ans = 0, {"error": repr(e)[:200]}  # so post again in a second
                rec["tries"] = rec.get("tries", 0) + 1
                if rec["tries"] < args.give_up_s:
                    pending.append((time.time() + 1.0, rec))
                    continue
            out.write(
                json.dumps(
                    {
                        "session_id": rec["session_id"],
                        "reward": r,
                        "status": st,
                        "state": ans.get("state"),
                        "time": time.time(),
                    }
                )
                + "\n"
            )
            out.flush()
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("role", choices=["all", "talk", "reward"])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data", help="the task file (JSONL with prompt and answer)")
    p.add_argument("--log-dir", help="default: <run_dir>/agents")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--agent", type=int, default=0)
    p.add_argument("--group", type=int, default=4, help="sessions per task (rollout.n_samples)")
    p.add_argument("--sessions", type=int, default=10**9, help="rounds per process")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--delay", type=float, default=2.0, help="seconds before a reward")
    p.add_argument(
        "--reward",
        choices=["chars", "exact"],
        default="chars",
        help="chars: the fraction of matching characters; exact: 1 for the answer",
    )
    p.add_argument(
        "--give-up-s",
        type=float,
        default=120.0,
        help="stop when the gateway is unreachable this long",
    )
    args = p.parse_args()
    args.log_dir = args.log_dir or str(Path(args.run_dir) / "agents")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    if args.role == "talk":
        return talk(args)
    if args.role == "reward":
        return reward(args)
    base = [
        sys.executable,
        __file__,
        "--run-dir",
        args.run_dir,
        "--log-dir",
        args.log_dir,
        "--agents",
        str(args.agents),
        "--group",
        str(args.group),
        "--give-up-s",
        str(args.give_up_s),
    ]
    procs = [
        subprocess.Popen(
            base[:2] + ["reward"] + base[2:] + ["--delay", str(args.delay), "--reward", args.reward]
        )
    ]
    procs += [
        subprocess.Popen(
            base[:2]
            + ["talk"]
            + base[2:]
            + [
                "--data",
                args.data,
                "--agent",
                str(a),
                "--sessions",
                str(args.sessions),
                "--max-tokens",
                str(args.max_tokens),
            ]
        )
        for a in range(args.agents)
    ]
    try:
        for pr in procs[1:]:
            pr.wait()
        time.sleep(args.delay + 2)  # the last rewards
    finally:
        for pr in procs:
            pr.terminate()


if __name__ == "__main__":
    main()
