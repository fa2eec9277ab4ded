#!/bin/sh
# The TypeScript client's checks, as `make test` (after pytest) and .ci/run call them: the generated types against
# the server's OpenAPI schema, the build, and the tests on a live Unwind (scripts/test.mjs; SQLite, or PostgreSQL
# when DATABASE_URL says so). Without Node.js it says so and passes, unless TS_REQUIRED=1 (CI) makes that a failure.
# Installs (npm ci) and builds only what is missing or stale, so parallel runs after one install share it.
set -eu
cd "${0%/*}/.."
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1 ||
   [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 18 ]; then
  echo "== TypeScript client: NOT TESTED: Node.js 18+ and npm are needed (apt-get install nodejs npm)"
  [ "${TS_REQUIRED:-0}" = 1 ] && exit 1
  exit 0
fi
stale() { [ ! -e "$1" ] || [ -n "$(find "$2" -newer "$1" -print -quit)" ]; }
if stale node_modules/.package-lock.json package-lock.json; then npm ci --no-audit --no-fund --loglevel=error; fi
if stale ../../examples/typescript/node_modules/.package-lock.json ../../examples/typescript/package-lock.json; then
  (cd ../../examples/typescript && npm ci --no-audit --no-fund --loglevel=error)
fi
echo "== TypeScript client: types, build, tests"
npm run -s check-types
if stale dist/index.js src; then npm run -s build; fi
npm test
