#!/usr/bin/env python
"""Export the adapters of a LoRA run's checkpoint as a PEFT directory, or merge them into the
base model as a full Hugging Face directory.

    python tools/export_lora.py --ckpt RUN/checkpoints[/iter_N] --out ADAPTER_DIR
    python tools/export_lora.py --ckpt RUN/checkpoints --merge-into MERGED_DIR [--base HF_DIR]

--ckpt is a LoRA run's checkpoint root (its `latest` is used) or one iter_XXXXXXX directory
(written with lora.enabled: adapters and optimizer only). --out gets adapter_config.json and
adapter_model.safetensors (peft.PeftModel.from_pretrained / SGLang's LoRA loading read them).
--merge-into gets the base model's config, tokenizer and safetensors with every adapted weight
replaced by W + (alpha / r) B A. The base model is --base or the path the checkpoint records;
its files must match the identity recorded at training time (--ignore-base-identity skips that
check, e.g. for a copy of the base with new file times). One process, CPU only.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _argtypes import float_range  # noqa: E402  (tools/ is sys.path[0] when run as a script)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt", required=True, help="LoRA checkpoint root or iter_* directory")
    p.add_argument("--out", help="write the PEFT adapter directory here")
    p.add_argument("--merge-into", help="write the base model with the adapters merged here")
    p.add_argument("--base", help="base HF model directory (default: the recorded one)")
    p.add_argument(
        "--ignore-base-identity",
        action="store_true",
        help="do not compare the base model's files with the recorded identity",
    )
    p.add_argument(
        "--max-shard-size",
        type=float_range(0.0, lo_open=True),
        default=2.0,
        help="GiB per safetensors shard of --merge-into",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", help="write a JSON report (paths, counts) here")
    a = p.parse_args(argv)
    if not a.out and not a.merge_into:
        p.error("nothing to do: give --out (PEFT adapter) and/or --merge-into (merged model)")
    from areal_mega.checkpoint.dist_ckpt import CheckpointError
    from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
    from areal_mega.checkpoint.safetensors_io import SafetensorsError
    from areal_mega.lora.ckpt_export import (
        export_peft_adapter,
        merge_into_base,
        open_lora_checkpoint,
    )

    report = {}
    try:
        ck = open_lora_checkpoint(a.ckpt, base=a.base, check_identity=not a.ignore_base_identity)
        if a.out:
            report["adapter"] = export_peft_adapter(ck, a.out)
            print(
                f"wrote {a.out} ({report['adapter']['tensors']} adapter tensors, "
                f"r={ck.record['rank']}, iteration {ck.iteration})"
            )
        if a.merge_into:
            report["merged"] = merge_into_base(
                ck,
                a.merge_into,
                max_shard_bytes=int(a.max_shard_size * 1024**3),
                progress=not a.no_progress,
            )
            print(
                f"wrote {a.merge_into} ({report['merged']['merged']} of "
                f"{report['merged']['tensors']} weights merged)"
            )
    except (CheckpointError, UnsupportedModelError, SafetensorsError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.report:
        Path(a.report).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
