"""TRL's side of bench/vs_trl/run.py; runs in TRL's own environment (``make trl-env``, .venv-trl).

    .venv-trl/bin/python -m bench.vs_trl.trl_side --model DIR --train FILE --out DIR [--steps N ...]

TRL's ``GRPOTrainer`` on the bench's model directory (any HF causal LM with its tokenizer) and
prompt file (plain-text prompts, or chat-form ones rendered with the tokenizer's chat template),
with the reward function our side names (``module:function``, imported from this repository:
the parent puts its root on PYTHONPATH). Writes into ``--out``:

* ``steps.jsonl``: one line per optimizer step: ``step``, ``time`` (the step's end, from a
  ``TrainerCallback``'s ``on_step_end``), ``wall`` (seconds since the previous step's end, or
  since ``on_train_begin`` for the first), ``reward`` (TRL's logged mean reward),
  ``num_tokens`` (TRL's cumulative prompt + completion tokens), ``generate_s`` (inside
  ``model.generate``), ``rollout_s`` (TRL's whole ``_prepare_inputs``: generation, rewards,
  advantages), ``step_time`` (TRL's own ``step_time`` metric), ``completion_len``,
  ``peak_rss_gib`` (this process's ``VmHWM``) and ``paused_s`` (seconds spent saving
  snapshots before this step's end, left out of ``wall``);
* ``timing.json``: ``on_train_begin``'s time (``begin``) and the seconds spent saving
  snapshots (``paused_s``);
* ``snapshots/step<N>``: the model and tokenizer after each step of ``--snapshots`` (the bench
  evaluates them on the held-out prompts afterwards, with our evaluation CLI);
* ``meta.json``: versions, threads and the effective ``GRPOConfig`` fields that define the work.

The two timings come from TRL's own profiling contexts (``trl.extras.profiling``), which only
report to wandb, mlflow or trackio: their ``_log_metrics`` is replaced by one that adds each
duration to this process's table, read and cleared at every step's end.
"""

import argparse
import importlib
import json
import time
from collections import defaultdict
from pathlib import Path

PROFILED = defaultdict(float)  # "GRPOTrainer.<block>" -> seconds since the last step's end


def load_reward(spec: str):
    """The function ``spec`` (``package.module:function``) names."""
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--reward {spec!r}: expected package.module:function")
    return getattr(importlib.import_module(module), name)


def trl_reward(fn, eos_ids, render=None):
    """``fn(prompt, completion, answer, finish_reason=...)`` (our reward signature) as a TRL
    reward function: ``(prompts, completions, completion_ids, answer, **kw) -> [float]``. The
    finish reason is ``stop`` where the completion's ids end with one of ``eos_ids`` (TRL keeps
    the EOS in ``completion_ids`` and calls a completion truncated when its last id is no EOS,
    ``GRPOTrainer.eos_token_ids``), else ``length``: our rollout's rule
    (``rollout.controller.model_finish``). TRL decodes completions without special tokens, as
    our rollout does. Chat-form (conversational) samples: the completion is the assistant
    message's text and the prompt the chat template's rendering ``render(messages)`` (what our
    reward functions receive as the prompt)."""
    ends = set(eos_ids)

    def text(x):
        return x[-1]["content"] if isinstance(x, list) else x

    def reward(prompts, completions, completion_ids, answer, **kw):
        return [
            float(
                fn(
                    render(p) if isinstance(p, list) and render else text(p),
                    text(c),
                    a,
                    finish_reason="stop" if ids and ids[-1] in ends else "length",
                )
            )
            for p, c, ids, a in zip(prompts, completions, completion_ids, answer)
        ]

    reward.__name__ = fn.__name__
    return reward


def eos_token_ids(tok, model) -> list:
    """The ids that end a sample: the tokenizer's EOS and the generation config's (one or a
    list), as ``GRPOTrainer`` collects them."""
    ids = [tok.eos_token_id]
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids += gen if isinstance(gen, (list, tuple)) else [gen]
    return sorted({i for i in ids if i is not None})


def vmhwm_gib() -> float:
    """This process's resident-set high-water mark (Linux ``VmHWM``), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def patch_profiling() -> None:
    """Make TRL's profiling contexts add their durations to :data:`PROFILED`."""
    from trl.extras import profiling

    def _log_metrics(self, duration: float) -> None:
        PROFILED[self.name] += duration

    profiling.ProfilingContext._log_metrics = _log_metrics


def step_logger(path: Path, snapshots=(), snapshot_dir: Path = None, tok=None):
    """A ``TrainerCallback`` writing one JSON line per optimizer step to ``path``; after the
    steps in ``snapshots`` it saves the model (and ``tok``) to ``snapshot_dir/step<N>`` for the
    held-out evaluation the bench runs afterwards. Saving is no training: its seconds are left
    out of the next step's ``wall`` and summed in each row's ``paused_s`` (the saves before this
    row's ``time``); ``path``'s sibling ``timing.json`` holds ``on_train_begin``'s time
    (``begin``) and, at the end, all the saving's seconds (``paused_s``)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self):
            self.t_prev, self.row, self.paused = None, None, 0.0
            self.f = open(path, "w")

        def on_train_begin(self, args, state, control, **kw):
            self.t_prev = self.begin = time.time()

        def on_step_end(self, args, state, control, model=None, **kw):
            now = time.time()
            self.row = {
                "step": state.global_step,
                "time": now,
                "wall": now - self.t_prev,
                "paused_s": self.paused,
                "generate_s": PROFILED.get("GRPOTrainer.transformers.generate", 0.0),
                "rollout_s": PROFILED.get("GRPOTrainer._prepare_inputs", 0.0),
            }
            PROFILED.clear()
            if state.global_step in snapshots:
                out = snapshot_dir / f"step{state.global_step}"
                model.save_pretrained(out)
                if tok is not None:
                    tok.save_pretrained(out)
                self.paused += time.time() - now
            self.t_prev = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs or self.row is None:
                return  # the end-of-training summary
            self.row.update(
                reward=logs["reward"],
                num_tokens=logs.get("num_tokens"),
                step_time=logs.get("step_time"),
                completion_len=logs.get("completions/mean_length"),
                peak_rss_gib=vmhwm_gib(),
            )
            self.f.write(json.dumps(self.row) + "\n")
            self.f.flush()
            self.row = None

        def on_train_end(self, args, state, control, **kw):
            self.f.close()
            timing = {"begin": self.begin, "paused_s": self.paused}
            (path.parent / "timing.json").write_text(json.dumps(timing))

    return StepLog()


def arguments(argv=None, *, description: str):
    """The command line both TRL scripts share (this one and bench/vs_trl/trl_step.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="JSONL with prompt and answer")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="per_device_train_batch_size; 0 = the whole step's samples at once",
    )
    p.add_argument(
        "--grad-ckpt",
        action="store_true",
        help="gradient checkpointing (GRPOConfig's default; off unless given)",
    )
    p.add_argument("--reward", default="areal_mega.rewards:char_match_reward")
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: GRPOConfig(bf16=True), the Trainer's autocast over the fp32 model",
    )
    p.add_argument(
        "--snapshots",
        default="",
        help="steps after which the model is saved to OUT/snapshots/step<N> (comma-separated)",
    )
    return p.parse_args(argv)


def build_trainer(a, callbacks=()):
    """TRL's ``GRPOTrainer`` as the bench asks (see the module docstring): ``(trainer, cfg,
    tokenizer)`` with torch's threads set; ``callbacks``: ``TrainerCallback`` objects, or
    functions of the tokenizer that return one. Prompts in chat form (lists of messages) make
    TRL apply the tokenizer's chat template (``add_generation_prompt``), as our trainer does
    with ``data.apply_chat_template``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    samples = a.prompts * a.group
    micro = a.micro_batch or samples
    if samples % micro:
        raise SystemExit(f"--micro-batch {micro} must divide prompts x group = {samples}")
    # as GRPOTrainer loads a tokenizer itself: prompts padded (and cut) on the left
    tok = AutoTokenizer.from_pretrained(a.model, padding_side="left", truncation_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(a.train).read_text().splitlines() if x.strip()]
    data = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows]
    )

    def render(messages):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # one optimizer step = gradient_accumulation_steps micro-batches of per_device_train_batch
    # samples = one generation batch of prompts x group samples (steps_per_generation defaults
    # to gradient_accumulation_steps); num_iterations 1: each batch is trained once
    cfg = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=a.dtype == "bf16",
        fp16=False,
        beta=0.0,
        num_generations=a.group,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,
        max_completion_length=a.max_new,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        epsilon=0.2,
        max_steps=a.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=a.grad_ckpt,
        seed=a.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(load_reward(a.reward), eos_token_ids(tok, model), render)],
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[c if isinstance(c, TrainerCallback) else c(tok) for c in callbacks],
    )
    return trainer, cfg, tok


def main(argv=None) -> None:
    """Run TRL's GRPO as the bench asks (see the module docstring)."""
    a = arguments(argv, description=__doc__.split("\n")[0])
    import torch
    import transformers
    import trl

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    patch_profiling()
    snapshots = {int(x) for x in a.snapshots.split(",") if x.strip()}
    trainer, cfg, tok = build_trainer(
        a, [lambda tok: step_logger(out / "steps.jsonl", snapshots, out / "snapshots", tok)]
    )
    meta = {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "config": {
            k: getattr(cfg, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "generation_batch_size",
                "steps_per_generation",
                "num_generations",
                "max_completion_length",
                "learning_rate",
                "lr_scheduler_type",
                "beta",
                "num_iterations",
                "loss_type",
                "scale_rewards",
                "epsilon",
                "temperature",
                "gradient_checkpointing",
                "optim",
                "max_steps",
                "bf16",
                "use_cpu",
            )
        },
    }
    meta["config"]["optim"] = str(meta["config"]["optim"])
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    trainer.train()


if __name__ == "__main__":
    main()
