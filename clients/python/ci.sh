#!/usr/bin/env bash
# CI for the Python client, from a clean checkout:
#
#   ONCEGATE_BIN=/path/to/oncegate bash clients/python/ci.sh [pytest arguments...]
#
# Creates a virtualenv (clients/python/.venv, or $VENV), installs the package with its
# test extras (the gRPC stubs are generated from crates/oncegate-proto/proto during the
# install), runs `mypy --strict` on the package when ONCEGATE_PY_TYPECHECK=1, and runs
# pytest. The tests start their own `oncegate serve`: $ONCEGATE_BIN, else
# <repo>/target/release/oncegate, else <repo>/target/debug/oncegate. $PYTHON picks the
# interpreter (default python3; 3.9 or newer).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
python="${PYTHON:-python3}"
venv="${VENV:-$here/.venv}"

if [[ -n "${ONCEGATE_BIN:-}" ]]; then
    [[ -x "$ONCEGATE_BIN" ]] || { echo "ci.sh: ONCEGATE_BIN=$ONCEGATE_BIN is not an executable file" >&2; exit 2; }
    echo "ci.sh: server binary $ONCEGATE_BIN"
else
    echo "ci.sh: ONCEGATE_BIN is not set; the tests look in ../../target/{release,debug}/oncegate"
fi

"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet --upgrade ".[test]"
if [[ "${ONCEGATE_PY_TYPECHECK:-0}" == 1 ]]; then
    "$venv/bin/python" -m pip install --disable-pip-version-check --quiet ".[typecheck]"
    "$venv/bin/python" -m mypy src/oncegate tests
fi
exec "$venv/bin/python" -m pytest "$@"
