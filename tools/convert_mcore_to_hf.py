#!/usr/bin/env python
"""Convert a megatron-core dist_checkpointing checkpoint back to a Hugging Face directory.

    python tools/convert_mcore_to_hf.py --mcore-dir OUT --out DIR2 [--dtype bf16|fp32]

--mcore-dir is a checkpoint root (its `latest` is used) or one iter_XXXXXXX directory, written
by convert_hf_to_mcore.py or by training. DIR2 gets config.json, tokenizer files and
model-0000i-of-0000N.safetensors with model.safetensors.index.json (a vision-language model:
also its image processor's preprocessor_config.json; areal_mega/checkpoint/vl_convert.py).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _argtypes import float_range  # noqa: E402  (tools/ is sys.path[0] when run as a script)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mcore-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32", "fp16"],
        default=None,
        help="default: the checkpoint's dtype",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        help="HF dir with config/tokenizer if the checkpoint has no hf/ copy",
    )
    p.add_argument(
        "--max-shard-size",
        type=float_range(0.0, lo_open=True),
        default=2.0,
        help="GiB per safetensors shard",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", help="write a JSON report (paths, memory) here")
    a = p.parse_args(argv)
    from areal_mega.checkpoint.convert import convert_mcore_to_hf
    from areal_mega.checkpoint.dist_ckpt import CheckpointError
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
    from areal_mega.checkpoint.vl_convert import (
        checkpoint_config_dir,
        convert_vl_mcore_to_hf,
        is_vl_model_dir,
    )

    try:
        kw = dict(
            dtype=a.dtype,
            hf_config_dir=a.hf_config,
            max_shard_bytes=int(a.max_shard_size * 1024**3),
        )
        if is_vl_model_dir(checkpoint_config_dir(a.mcore_dir, a.hf_config)):
            rep = convert_vl_mcore_to_hf(a.mcore_dir, a.out, **kw)
        else:
            rep = convert_mcore_to_hf(a.mcore_dir, a.out, **kw, progress=not a.no_progress)
    except (UnsupportedModelError, CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.report:
        Path(a.report).write_text(json.dumps(rep, indent=2, default=str))
    print(f"wrote {rep['path']} ({rep['tensors']} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
