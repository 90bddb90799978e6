#!/usr/bin/env bash
# CI for the TypeScript client, from a clean checkout: installs exactly what
# package-lock.json pins (which builds the package: proto copy, typed stubs, tsc), then runs
# the tests against a real `oncegate serve` that the tests start themselves.
#
# Usage: ONCEGATE_BIN=/path/to/oncegate clients/typescript/ci.sh
# Without ONCEGATE_BIN the tests look for <repo>/target/release/oncegate, then
# <repo>/target/debug/oncegate. Needs node >= 20 and npm; openssl for the mutual-TLS test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [[ -n "${ONCEGATE_BIN:-}" ]]; then
  export ONCEGATE_BIN
  [[ -x "$ONCEGATE_BIN" ]] || { echo "ONCEGATE_BIN=$ONCEGATE_BIN is not an executable" >&2; exit 2; }
fi
npm ci --no-audit --no-fund
npm test
