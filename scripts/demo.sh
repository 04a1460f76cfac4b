#!/usr/bin/env bash
# What only pd-router does, on a fresh machine: set everything up, start a simulated 2P+2D fleet and
# pd-router in front of it, then (scripts/demo.py) send requests without pause while one decode server is
# converted to prefill and every server's weights are updated, both with `pd-router ctl`; print what happened
# (requests ok/failed, roles before and after, weight versions), send one more request, stop everything.
# Exits non-zero if anything failed. For tests: DEMO_SKIP_SETUP=1 skips scripts/setup.sh, DEMO_PYTHON is the
# Python with pd-router installed (default: .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${DEMO_SKIP_SETUP:-0}" = 1 ] || scripts/setup.sh
PY=${DEMO_PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

# servers that take a little time, as real ones do: 10 ms a decode step, 0.3 s a role switch
$PY -m simulator.fleet --prefill 2 --decode 2 --decode-step-s 0.01 --prefill-overhead-s 0.005 \
  --role-switch-s 0.3 > "$WORK/fleet.json" 2> "$WORK/fleet.log" &
for _ in $(seq 100); do [ -s "$WORK/fleet.json" ] && break; sleep 0.1; done
[ -s "$WORK/fleet.json" ] || { echo "fleet did not start:"; cat "$WORK/fleet.log"; exit 1; }
ARGS=$($PY -m simulator.fleet --router-args < "$WORK/fleet.json")
ROUTER_PORT=${ROUTER_PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
echo "fleet: $(cat "$WORK/fleet.json")"
echo "starting: pd-router $ARGS --host 127.0.0.1 --port $ROUTER_PORT"
$PY -m router $ARGS --host 127.0.0.1 --port "$ROUTER_PORT" > "$WORK/router.log" 2>&1 &
for _ in $(seq 100); do curl -sf "127.0.0.1:$ROUTER_PORT/health" >/dev/null && break; sleep 0.1; done
curl -sf "127.0.0.1:$ROUTER_PORT/health" >/dev/null || { echo "router did not start:"; cat "$WORK/router.log"; exit 1; }
echo
if ! $PY scripts/demo.py --router "http://127.0.0.1:$ROUTER_PORT"; then
  echo; echo "the router's log (last lines):"; tail -n 30 "$WORK/router.log"
  exit 1
fi
