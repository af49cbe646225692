"""TRL's side of bench/vs_trl/step.py: one real ``GRPOTrainer`` step, with what it trained on.

    .venv-trl/bin/python -m bench.vs_trl.trl_step --model DIR --train FILE --out DIR \
        [--prompts N ...]

The trainer of bench/vs_trl/trl_side.py (same ``GRPOConfig``), ``max_steps`` 1. Its own
``_generate_and_score_completions`` is wrapped to keep its output; its reward function to keep
the rewards. Writes into ``--out``:

* ``batch.json``: per sample (TRL's order) the prompt ids (padding removed), completion ids
  (up to and with the first EOS), the reward, TRL's advantage, and the behaviour logprobs: the
  log-probability of each completion token under the weights that sampled it (TRL's own
  ``_get_per_token_logps_and_entropies`` before the step, as a rollout server reports them);
  plus the EOS and pad ids, TRL's logged ``loss`` and ``grad_norm`` (before clipping) and
  the versions;
* ``grads.safetensors``: every parameter's gradient as the optimizer got it (after clipping
  to ``max_grad_norm``; HF names; a tied ``lm_head`` is the embedding's);
* ``after.safetensors``: every parameter after the optimizer step.
"""

import json
from pathlib import Path

from bench.vs_trl.trl_side import arguments, build_trainer


def main(argv=None) -> None:
    """One GRPO step of TRL's trainer; write what it trained on and what it did."""
    a = arguments(argv, description=__doc__.split("\n")[0])
    import torch
    import transformers
    import trl
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.steps = 1
    kept = {}

    class KeepGrads(TrainerCallback):
        """The gradients the optimizer is about to apply (after clipping) and the step's
        logged loss and grad norm."""

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            kept["grads"] = {
                n: p.grad.detach().clone().contiguous()
                for n, p in model.named_parameters()
                if p.grad is not None
            }

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                kept["log"] = dict(logs)

    trainer, cfg, tok = build_trainer(a, [KeepGrads()])
    reward_fn = trainer.reward_funcs[0]

    def keep_rewards(*args, **kw):
        r = reward_fn(*args, **kw)
        kept.setdefault("rewards", []).extend(r)
        return r

    keep_rewards.__name__ = reward_fn.__name__
    trainer.reward_funcs[0] = keep_rewards
    generate_and_score = trainer._generate_and_score_completions

    def keep_batch(inputs):
        batch = generate_and_score(inputs)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with torch.no_grad():
            logps, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, batch["completion_ids"].size(1)
            )[:2]
        kept["batch"] = {
            k: batch[k]
            for k in (
                "prompt_ids",
                "prompt_mask",
                "completion_ids",
                "completion_mask",
                "advantages",
            )
        }
        kept["batch"]["logps"] = logps
        return batch

    trainer._generate_and_score_completions = keep_batch
    trainer.train()

    b = kept["batch"]
    samples = []
    for i in range(b["prompt_ids"].shape[0]):
        pm, cm = b["prompt_mask"][i].bool(), b["completion_mask"][i].bool()
        samples.append(
            {
                "prompt_ids": b["prompt_ids"][i][pm].tolist(),
                "completion_ids": b["completion_ids"][i][cm].tolist(),
                "logprobs": b["logps"][i][cm].tolist(),
                "reward": float(kept["rewards"][i]),
                "advantage": float(b["advantages"][i]),
            }
        )
    log = kept["log"]
    (out / "batch.json").write_text(
        json.dumps(
            {
                "samples": samples,
                "group": a.group,
                "eos_id": tok.eos_token_id,
                "pad_id": tok.pad_token_id,
                "loss": log["loss"],
                "grad_norm": log["grad_norm"],
                "max_grad_norm": cfg.max_grad_norm,
                "versions": f"TRL {trl.__version__}, transformers {transformers.__version__}, "
                f"torch {torch.__version__}",
                "loss_type": cfg.loss_type,
                "scale_rewards": cfg.scale_rewards,
            }
        )
    )
    save_file(kept["grads"], str(out / "grads.safetensors"))
    save_file(
        {n: p.detach().contiguous() for n, p in trainer.model.named_parameters()},
        str(out / "after.safetensors"),
    )


if __name__ == "__main__":
    main()
