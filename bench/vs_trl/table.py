"""One markdown table of several bench/vs_trl/run.py runs: one row per dtype x max new tokens x
SFT warm-start steps x eta, ours against TRL (issue 54's grid).

    d=runs/grid; for mn in 16 128; do for dt in fp32 bf16; do
        n=$([ $dt = bf16 ] && echo -bf16)$([ $mn = 16 ] || echo -new$mn)
        python -m bench.vs_trl --sft-steps 30 --max-new $mn --dtype $dt --out $d
        python -m bench.vs_trl --sft-steps 30 --max-new $mn --dtype $dt --eta 0 --out $d \\
            --trl-from $d/vs_trl$n.json
    done; done
    python -m bench.vs_trl.table runs/grid/vs_trl*.json

Each row: both sides' median s/step, the ratio (TRL s/step over ours), held-out greedy pass@1
and mean reward after the last step (both scored by ``python -m areal_mega.eval``), the
trainer's achieved FLOP/s as a fraction of the matmul peak of the run's dtype on its threads,
and the peak memory of all processes together (PSS) with its ratio to TRL's. Runs of other RL
seeds (``--rl-seed``) are left to bench/vs_trl/seeds.py and skipped here unless ``--all-seeds``.

``--recount`` measures the matmul peaks once, now (run it on a quiet machine), and counts every
run's model FLOPs again with the current bench/vs_trl/flops.py from its stored steps, so that
runs made at different moments (or before a change of the count) are held against one peak.
"""

import argparse
import json
from pathlib import Path

from bench.vs_trl.flops import achieved_flops, dtype_peak, matmul_peaks, model_dims
from bench.vs_trl.report import peaks_text

COLUMNS = (
    "dtype",
    "new tokens",
    "SFT steps",
    "eta",
    "ours s/step",
    "TRL s/step",
    "ratio",
    "pass@1 after (ours / TRL)",
    "reward after (ours / TRL)",
    "trainer % of peak (ours / TRL)",
    "peak GiB (ours / TRL)",
    "memory ratio",
)


def peak_fraction(res: dict, side: str) -> float:
    """``side``'s trainer FLOP/s over the matmul peak of the run's dtype on its threads (NaN
    when the run has no FLOPs part for it)."""
    fl = res.get("flops") or {}
    part = fl.get(side) or {}
    v = (part.get("flop_s") or {}).get("train")
    threads = (part.get("threads") or {}).get("train")
    if v is None or threads is None:
        return float("nan")
    return v / dtype_peak(fl["peak"], threads, res["run"].get("dtype", "fp32"))


def model_config(res: dict) -> dict:
    """The ``config.json`` of the model a run trained: ``--model``'s, else the synthetic model
    in the run's directory (its SFT warm start's where there was one)."""
    run = res["run"]
    if run.get("model"):
        path = Path(run["model"]) / "config.json"
    else:
        out = Path(res["ours"]["run_dir"]).parent
        path = out / ("sft/hf_model" if run.get("sft_steps") else "model") / "config.json"
    return json.loads(path.read_text())


def recount(res: dict, peaks: dict) -> None:
    """Replace ``res``'s FLOPs part with the current count (:func:`achieved_flops`) against
    ``peaks`` (:func:`matmul_peaks`' result)."""
    run, settings = res["run"], res["ours"]["settings"]
    threads = {
        "server": settings["server_threads"],
        "trainer": settings["trainer_threads"],
        "trl": len(res["cpu"]["cpus"]),
    }
    dims = model_dims(model_config(res))
    counted = achieved_flops(res, dims, run["prompts"] * run["group"], threads, run["group"])
    res["flops"] = {"peak": peaks, **counted, "recounted": True}


def table_row(res: dict) -> dict:
    """One vs_trl.json's row (see the module docstring); TRL's cells NaN without a TRL side."""
    nan = float("nan")
    trl = res.get("trl") or {}
    ours_s = res["ours"]["summary"]["s_per_step"]
    trl_s = (trl.get("summary") or {}).get("s_per_step", nan)
    ours_mem, trl_mem = res["ours"].get("peak_pss_gib"), trl.get("peak_pss_gib")
    after = {side: (res.get(side) or {}).get("after") or {} for side in ("ours", "trl")}
    return {
        "dtype": res["run"].get("dtype", "fp32"),
        "max_new": res["run"]["max_new"],
        "sft_steps": int(res["run"].get("sft_steps") or 0),
        "eta": res["ours"]["settings"]["eta"],
        "rl_seed": res["run"].get("rl_seed", res["run"]["seed"]),
        "ours_s": ours_s,
        "trl_s": trl_s,
        "ratio": trl_s / ours_s if ours_s else nan,
        "pass_ours": after["ours"].get("pass@1", nan),
        "pass_trl": after["trl"].get("pass@1", nan),
        "reward_ours": after["ours"].get("reward", nan),
        "reward_trl": after["trl"].get("reward", nan),
        "peak_ours": peak_fraction(res, "ours"),
        "peak_trl": peak_fraction(res, "trl"),
        "mem_ours": nan if ours_mem is None else ours_mem,
        "mem_trl": nan if trl_mem is None else trl_mem,
    }


def _f(v: float, fmt: str) -> str:
    return "-" if v != v else fmt.format(v)


def markdown(rows: list) -> str:
    """The rows as a markdown table, ordered by dtype (fp32 first), new tokens, SFT warm-start
    steps (most first), eta, seed."""
    order = sorted(
        rows,
        key=lambda r: (r["dtype"] != "fp32", r["max_new"], -r["sft_steps"], r["eta"], r["rl_seed"]),
    )
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in order:
        cells = [
            r["dtype"],
            str(r["max_new"]),
            str(r["sft_steps"]),
            str(r["eta"]),
            _f(r["ours_s"], "{:.2f}"),
            _f(r["trl_s"], "{:.2f}"),
            _f(r["ratio"], "{:.2f}x"),
            f"{_f(r['pass_ours'], '{:.3f}')} / {_f(r['pass_trl'], '{:.3f}')}",
            f"{_f(r['reward_ours'], '{:.3f}')} / {_f(r['reward_trl'], '{:.3f}')}",
            f"{_f(100 * r['peak_ours'], '{:.0f}%')} / {_f(100 * r['peak_trl'], '{:.0f}%')}",
            f"{_f(r['mem_ours'], '{:.2f}')} / {_f(r['mem_trl'], '{:.2f}')}",
            _f(r["mem_ours"] / r["mem_trl"], "{:.2f}x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Print the table of the vs_trl.json files given."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("results", nargs="+", help="vs_trl*.json files of bench/vs_trl/run.py")
    p.add_argument(
        "--all-seeds",
        action="store_true",
        help="a row for every RL seed (default: each file's first seed only, --seed's)",
    )
    p.add_argument(
        "--recount",
        action="store_true",
        help="measure the matmul peaks now and count every run's FLOPs again against them",
    )
    a = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in a.results]
    if a.recount:
        cpus = results[0]["cpu"]["cpus"]
        peaks = matmul_peaks(cpus, [1, len(cpus)])
        print(f"matmul peaks now, GFLOP/s: {peaks_text(peaks)}")
        for res in results:
            recount(res, peaks)
    rows = [table_row(r) for r in results]
    if not a.all_seeds:
        rows = [
            row
            for row, res in zip(rows, results)
            if row["rl_seed"] == res["run"].get("seed", row["rl_seed"])
        ]
    cpu = {
        f"{r['cpu']['model']}, {r['cpu']['isa']}, bf16: {r['cpu'].get('bf16', 'not recorded')}"
        for r in results
    }
    print(f"CPU: {'; '.join(sorted(cpu))}")
    print(markdown(rows))


if __name__ == "__main__":
    main()
