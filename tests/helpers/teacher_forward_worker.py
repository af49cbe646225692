"""Worker of tests/test_teacher_scoring_engine.py: the teacher's forward in the trainer, as the
trainer builds it (one process, gloo): HF directory -> ``convert_hf_to_mcore`` ->
``load_checkpoint`` into a forward-only ``MegatronEngine`` (role ``ref``) -> ``forward_logprobs``
over packed sequences. Writes ``{"logprobs": [[log p(ids[t] | ids[:t]) for t >= start], ...]}``.

    python -m tests.helpers.teacher_forward_worker HF_DIR WORK_DIR IN_JSON OUT_JSON
"""

import json
import sys
from pathlib import Path

import numpy as np

from areal_mega.checkpoint.convert import _single_process_mesh, convert_hf_to_mcore
from areal_mega.checkpoint.dist_ckpt import load_checkpoint
from areal_mega.config import ModelConfig
from areal_mega.engine import MegatronEngine
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout


def main() -> None:
    hf_dir, work, in_json, out_json = sys.argv[1:5]
    job = json.loads(Path(in_json).read_text())
    ckpt = Path(work) / "mcore"
    convert_hf_to_mcore(hf_dir, ckpt, dtype="fp32", progress=False)
    mesh = _single_process_mesh()
    eng = MegatronEngine(ModelConfig(dtype="fp32", path=hf_dir), role="ref", mesh=mesh)
    load_checkpoint(ckpt, eng.model_chunks(), load_optimizer=False, load_rng=False)
    samples = []
    for ids, start in zip(job["seqs"], job["starts"]):
        ids = np.asarray(ids, dtype=np.int64)
        mask = (np.arange(len(ids)) >= start).astype(np.uint8)
        samples.append(next_token_layout(ids, loss_mask=mask))
    mb = pack_sequences(samples)
    (lp,) = eng.forward_logprobs([mb])
    out = []
    for b, (ids, start) in enumerate(zip(job["seqs"], job["starts"])):
        s = int(mb["cu_seqlens"][b])
        # position t of the layout holds log p(ids[t + 1] | ids[:t + 1])
        out.append([float(x) for x in lp[s + start - 1 : s + len(ids) - 1]])
    Path(out_json).write_text(json.dumps({"logprobs": out}))
    mesh.destroy(process_group=True)


if __name__ == "__main__":
    main()
