"""Write areal_mega/checkpoint/bridge_tables.json from the installed Megatron-Bridge's mapping
registries (the HF <-> megatron tensor tables of the families we convert) and print what
changed.

    python tools/sync_bridge_tables.py           # rewrite the file
    python tools/sync_bridge_tables.py --check   # exit 1 if the file differs from the bridge
"""

import argparse
import json
import sys

from areal_mega.checkpoint.bridge_tables import SNAPSHOT, derive_tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare only, write nothing")
    args = ap.parse_args(argv)
    new = derive_tables()
    old = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    changed = [
        mt
        for key in ("families", "vl_families")
        for mt in sorted(set(new[key]) | set(old.get(key, {})))
        if new[key].get(mt) != old.get(key, {}).get(mt)
    ]
    if old.get("megatron_bridge") != new["megatron_bridge"]:
        print(f"megatron-bridge {old.get('megatron_bridge')} -> {new['megatron_bridge']}")
    for mt in changed:
        print(f"{mt}: table differs from {SNAPSHOT.name}")
    if args.check:
        return 1 if changed or old.get("megatron_bridge") != new["megatron_bridge"] else 0
    SNAPSHOT.write_text(json.dumps(new, indent=1) + "\n")
    names = [*new["families"], *new["vl_families"]]
    print(f"wrote {SNAPSHOT} ({len(names)} families: {', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
