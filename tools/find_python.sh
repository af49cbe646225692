#!/usr/bin/env bash
# Prints the path of a Python 3.<minor> interpreter, or exits 1 with one line on stderr saying what
# to install. Used by the Makefile (PYTHON, VLLM_PYTHON_BIN, TRL_PYTHON_BIN) and by .ci/run, so
# both find the same interpreter.
#   tools/find_python.sh 12   ->  /root/.pyenv/versions/3.12.1/bin/python3.12
# Looks at python3.<minor> on PATH, else the newest pyenv-installed 3.<minor>.* (pyenv's shim
# answers "command not found" when 3.<minor> is installed but not the selected version).
set -uo pipefail
minor=${1:?usage: tools/find_python.sh MINOR (e.g. 12 for Python 3.12)}
minor=${minor#3.}

if "python3.$minor" -c "import sys; assert sys.version_info[:2] == (3, $minor)" 2>/dev/null; then
    "python3.$minor" -c 'import sys; print(sys.executable)'
    exit 0
fi
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
found=$(ls -d "$root"/versions/3."$minor".*/bin/python3."$minor" 2>/dev/null | sort -V | tail -n 1)
if [[ -n $found && -x $found ]] &&
    "$found" -c "import sys; assert sys.version_info[:2] == (3, $minor)" 2>/dev/null; then
    echo "$found"
    exit 0
fi
echo "no Python 3.$minor found (python3.$minor on PATH or pyenv versions/3.$minor.*):" \
     "install it (e.g. pyenv install 3.$minor, or apt-get install python3.$minor-venv)" >&2
exit 1
