#!/usr/bin/env bash
# Prints the `uv pip install` flags for the package sources and constraints this machine's pip is
# configured with (PIP_* environment variables and pip's config files), so that the Makefile's
# installs through uv take what `pip install` would take here: local wheel directories
# (--find-links), extra indexes, an index replacing PyPI, and a constraints file. uv reads none of
# pip's configuration itself. (Paths and URLs with spaces are not supported: pip splits on them.)
#   tools/pip_sources.sh .venv/bin/python   ->  --find-links /opt/wheels --constraint /etc/...
set -uo pipefail
python=${1:?usage: tools/pip_sources.sh PYTHON (an interpreter with pip)}

"$python" -m pip config list 2>/dev/null | "$python" -c '
import sys

flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url",
         "index-url": "--index-url", "constraint": "--constraint"}
seen = []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    option = key.rsplit(".", 1)[-1]
    if option not in flags or not value:
        continue
    # pip prints each value as a Python string literal; several values are space-separated
    for item in value.strip("\x27\"").split():
        pair = (flags[option], item)
        if pair not in seen:
            seen.append(pair)
print(" ".join(f"{flag} {item}" for flag, item in seen))
'
