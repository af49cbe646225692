#!/usr/bin/env python
"""Print Megatron-Bridge's own ``AutoBridge.list_supported_models()`` and, for each
architecture, whether our trainer engine builds it and whether (and how) our CPU rollout
server runs it, as read from our code (areal_mega/inference/model_support.py).

    python tools/list_bridge_models.py [--json]

Markdown table by default (docs/model_families.md holds its output); ``--json``: the rows.
"""

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bridge_architectures() -> list:
    """Megatron-Bridge's ``AutoBridge.list_supported_models()`` (importing the bridge needs
    our scoped TransformerEngine placeholder when TE is not installed)."""
    from areal_mega.checkpoint.bridge_tables import import_bridge

    _, auto_bridge = import_bridge()
    return list(auto_bridge.list_supported_models())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # the bridge's import-time notices
    warnings.filterwarnings("ignore")
    from importlib.metadata import version

    import transformers

    from areal_mega.inference import model_support as ms
    from areal_mega.models.bridge_provider import GPU_ONLY, NOT_BUILT

    archs = bridge_architectures()
    engine, causal_lm = ms.engine_architectures(), ms.causal_lm_model_types()
    types = {engine.get(a) or (causal_lm.get(a) or [None])[0] for a in archs} - {None}
    rows = ms.support_rows(
        archs,
        engine=engine,
        causal_lm=causal_lm,
        kv_paths=ms.server_kv_paths(sorted(types)),
        transformers_classes=set(dir(transformers)),
        gpu_only=GPU_ONLY,
        not_built=NOT_BUILT,
        vl_trainer=ms.vl_trainer_architectures(),
        vl_not_built=ms.vl_not_built_architectures(),
        vl_rl=ms.vl_rl_architectures(),
    )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    served = [
        sum(r["server"] == label for r in rows)
        for label in (ms.SERVER_PATHS["static"], ms.ENGINE_HF_CACHE, ms.SERVER_PATHS["hf_cache"])
    ]
    print(
        f"Megatron-Bridge {version('megatron-bridge')}: {len(rows)} architectures; "
        f"transformers {transformers.__version__}; our engine builds "
        f"{sum(r['engine'] for r in rows)}; our CPU server runs {served[0]} with StaticKV "
        f"and {served[1]} through transformers' cache, loads {served[2]} more through "
        "transformers' cache; status: "
        + ", ".join(f"{sum(r['status'] == v for r in rows)} {v}" for v in ms.STATUS.values())
        + "\n"
    )
    print(ms.markdown_table(rows))
    ours = sorted(set(engine) - {r["architecture"] for r in rows})
    if ours:
        print(f"\nOur engine also builds (not in the bridge's list): {', '.join(ours)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
