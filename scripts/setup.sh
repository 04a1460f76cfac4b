#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install pd-router with its test, loadtest and docs extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,loadtest,docs]'
# SMG's RL client (smg.rl, standard library only) for tests/test_rl_*.py. Without its requirements: those
# (grpcio, grpcio-health-checking, setproctitle) serve SMG's own gateway, which the tests never start.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'smg==1.13.0' \
  || echo "warning: smg==1.13.0 not installed; the tests that drive SMG's client will be skipped" >&2
# Debian's Chromium for the docs site's browser test (tests/test_docs_site.py): installed where this runs as root
# with apt (a fresh CI machine, a container); elsewhere the test is skipped and says why.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: chromium not installed; tests/test_docs_site.py will be skipped" >&2
  else
    echo "note: no /usr/bin/chromium (apt-get install chromium): tests/test_docs_site.py will be skipped" >&2
  fi
fi
echo "pd-router installed in $(pwd)/.venv"
