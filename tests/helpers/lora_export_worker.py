"""A LoRA run's checkpoint for tests/test_lora_export_tool.py, made in its own process (the
engine needs torch.distributed; the pytest process must not initialise it).

    python -m tests.helpers.lora_export_worker <out_dir>

Everything is production code (tests/helpers/lora_worker.py's helpers): a tiny qwen3 model converted
to a base checkpoint, a LoRA actor (rank 8, all seven projections) with random adapters, one
training step, then ``engine.save`` into ``<out_dir>/run/checkpoints`` with the ``lora`` record
a training run writes (:func:`areal_mega.lora.actor.checkpoint_extra`). The actor's logprobs
after the step and the micro-batches they belong to go to ``<out_dir>/expected.pt``; the
converted base (``<out_dir>/mcore_qwen3``) is a full, non-LoRA checkpoint.
"""

import json
import os
import sys
import traceback

import torch

from tests.helpers import lora_worker as lw
from tests.helpers.engine_worker import TEMP, attach_policy_inputs


def make_checkpoint(out):
    from areal_mega.checkpoint.convert import convert_hf_to_mcore
    from areal_mega.lora.actor import checkpoint_extra
    from areal_mega.models.tiny import make_tiny_model
    from areal_mega.run_dir import hf_source_identity

    hf, ckpt = lw.model_paths(out, "qwen3")
    make_tiny_model(hf, arch="qwen3", tie_word_embeddings=False, **lw.MODELS["qwen3"])
    convert_hf_to_mcore(hf, ckpt, progress=False)
    lw.set_mesh()
    eng = lw.engine(hf, ckpt, lw.lora_cfg())
    lw.randomize_adapters(eng, 11)
    mbs = lw.make_data(3, pad=1)
    lps = eng.forward_logprobs(mbs, temperature=TEMP)
    for i, (mb, lp) in enumerate(zip(mbs, lps)):
        attach_policy_inputs(mb, lp, 300 + i)
    lw.train_once(eng, mbs)
    eng.save(
        os.path.join(out, "run", "checkpoints"),
        extra={"lora": checkpoint_extra(eng.lora, hf_source_identity(hf))},
    )
    after = eng.forward_logprobs(mbs, temperature=TEMP)
    torch.save(
        {
            "mbs": [{k: mb[k] for k in ("input_ids", "cu_seqlens", "seqlens")} for mb in mbs],
            "logprobs": after,
            "temperature": TEMP,
        },
        os.path.join(out, "expected.pt"),
    )


def main():
    out = sys.argv[1]
    from areal_mega.common.net import free_port

    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        LOCAL_RANK="0",
        MASTER_PORT=str(free_port()),
    )
    torch.set_num_threads(1)
    res: dict = {}
    try:
        make_checkpoint(out)
        res["ok"] = 1.0
    except Exception:
        res = {"error": traceback.format_exc()}
    with open(os.path.join(out, "make.0.json"), "w") as f:
        json.dump(res, f)
    if lw.MESH[0] is not None:
        lw.MESH[0].destroy()


if __name__ == "__main__":
    main()
