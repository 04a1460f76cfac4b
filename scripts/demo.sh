#!/usr/bin/env bash
# Set everything up, start a simulated 2P+2D fleet and pd-router in front of it, send one request
# through the router, print the answer, and stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PY=.venv/bin/python
WORK=$(mktemp -d)
cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

$PY -m simulator.fleet --prefill 2 --decode 2 > "$WORK/fleet.json" 2> "$WORK/fleet.log" &
for _ in $(seq 100); do [ -s "$WORK/fleet.json" ] && break; sleep 0.1; done
[ -s "$WORK/fleet.json" ] || { echo "fleet did not start:"; cat "$WORK/fleet.log"; exit 1; }
ARGS=$($PY -m simulator.fleet --router-args < "$WORK/fleet.json")
ROUTER_PORT=${ROUTER_PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
echo "fleet: $(cat "$WORK/fleet.json")"
echo "starting: pd-router $ARGS --host 127.0.0.1 --port $ROUTER_PORT"
.venv/bin/pd-router $ARGS --host 127.0.0.1 --port "$ROUTER_PORT" > "$WORK/router.log" 2>&1 &
for _ in $(seq 100); do curl -sf "127.0.0.1:$ROUTER_PORT/health" >/dev/null && break; sleep 0.1; done
curl -sf "127.0.0.1:$ROUTER_PORT/health" >/dev/null || { echo "router did not start:"; cat "$WORK/router.log"; exit 1; }
echo
echo "POST /generate through the router:"
curl -sS "127.0.0.1:$ROUTER_PORT/generate" -H 'Content-Type: application/json' \
  -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
echo
echo
echo "GET /workers:"
curl -sS "127.0.0.1:$ROUTER_PORT/workers"
echo
