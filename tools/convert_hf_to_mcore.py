#!/usr/bin/env python
"""Convert a Hugging Face model directory to a megatron-core dist_checkpointing checkpoint.

    python tools/convert_hf_to_mcore.py --hf-dir DIR --out OUT --tp 2 --pp 2 [--ep 2] [--etp 1]
        [--vpp 2] [--dtype bf16|fp32]

OUT gets iter_0000000/ (torch_dist files, hf/ config + tokenizer, areal_meta.json) and a
`latest` pointer. Any TP/PP/VPP/EP layout loads it (dist_checkpointing reshards); the layout
given here is validated against the model and sets the vocabulary padding. A vision-language
model (Qwen2.5-VL: areal_mega/checkpoint/vl_convert.py) converts for the single-rank layout
only, its image processor's preprocessor_config.json kept in hf/.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _argtypes import int_range  # noqa: E402  (tools/ is sys.path[0] when run as a script)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int_range(1), default=1)
    p.add_argument("--pp", type=int_range(1), default=1)
    p.add_argument("--ep", type=int_range(1), default=1)
    p.add_argument(
        "--etp", type=int_range(1), default=None, help="the experts' tensor parallel size (--tp)"
    )
    p.add_argument("--vpp", type=int_range(1), default=None)
    p.add_argument(
        "--dtype", choices=["bf16", "fp32", "fp16"], default=None, help="default: keep the HF dtype"
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int_range(1), default=128)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", help="write a JSON report (paths, memory) here")
    a = p.parse_args(argv)
    from areal_mega.checkpoint.convert import convert_hf_to_mcore
    from areal_mega.checkpoint.dist_ckpt import CheckpointError
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
    from areal_mega.checkpoint.safetensors_io import SafetensorsError
    from areal_mega.checkpoint.vl_convert import convert_vl_hf_to_mcore, is_vl_model_dir

    try:
        kw = dict(
            tp=a.tp,
            pp=a.pp,
            ep=a.ep,
            etp=a.etp,
            vpp=a.vpp,
            dtype=a.dtype,
            make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
        )
        # a vision-language model: the whole model at once (areal_mega/checkpoint/vl_convert.py)
        if is_vl_model_dir(a.hf_dir):
            rep = convert_vl_hf_to_mcore(a.hf_dir, a.out, **kw)
        else:
            rep = convert_hf_to_mcore(a.hf_dir, a.out, **kw, progress=not a.no_progress)
    except (UnsupportedModelError, SafetensorsError, CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.report:
        Path(a.report).write_text(json.dumps(rep, indent=2, default=str))
    print(f"wrote {rep['path']} ({rep['tensors']} HF tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
