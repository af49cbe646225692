#!/usr/bin/env python
"""Write a tiny HF-format causal LM with random weights and a local character tokenizer (or a
tiny Qwen2.5-VL with its image processor: --arch qwen2_5_vl).

    python tools/make_tiny_model.py --arch qwen3_moe --out /tmp/tiny-moe --hidden-size 64

No network access: the tokenizer is built with `tokenizers`, the weights are random.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _argtypes import float_range, int_range  # noqa: E402  (tools/ is sys.path[0])

from areal_mega.models.tiny import (  # noqa: E402
    ARCHS,
    CHARSETS,
    VL_ARCHS,
    TinyModelSpec,
    make_tiny_model,
)

# lower bounds of the numeric fields: sizes and counts >= 1, seed >= 0, floats finite and > 0
INT_LO = {"seed": 0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", choices=ARCHS + VL_ARCHS, required=True)
    p.add_argument("--out", required=True, help="output directory")
    for f in dataclasses.fields(TinyModelSpec):
        if f.name in ("arch",):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(
                flag,
                type=lambda s: s.lower() in ("1", "true", "yes"),
                default=None,
                help=f"default {f.default}",
            )
        elif f.name == "charset":
            p.add_argument(flag, choices=sorted(CHARSETS), default=None)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), type(f.default))
            kind = (
                int_range(INT_LO.get(f.name, 1))
                if kind is int
                else float_range(0.0, lo_open=True)
                if kind is float
                else kind
            )
            p.add_argument(flag, type=kind, default=None, help=f"default {f.default}")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k not in ("out",)}
    out = make_tiny_model(args.out, **overrides)
    print(f"wrote {args.arch} tiny model to {out}")


if __name__ == "__main__":
    main()
