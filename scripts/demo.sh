#!/usr/bin/env bash
# The main job on the embedded default: install, convert the default model once,
# start all four services on loopback, ask one question as a chat message (the target
# applies the model's chat template; the default model is a base model without one, so
# `generate` says so and sends the question as a plain prompt), stream the answer, shut down.
# Usage: bash scripts/demo.sh ["QUESTION"]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT="${1:-Explain in two sentences why the sky is blue.}"
bash scripts/setup.sh
specmesh models prepare
LOG="${TMPDIR:-/tmp}/specmesh-up.log"
echo "starting the four services on loopback (log: $LOG)"
specmesh up > "$LOG" 2>&1 &
UP_PID=$!
trap 'kill -INT $UP_PID 2>/dev/null; wait $UP_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  if python -m services.common.healthcheck 127.0.0.1:50051 >/dev/null 2>&1; then break; fi
  if ! kill -0 $UP_PID 2>/dev/null; then echo "specmesh up exited; see $LOG" >&2; tail -20 "$LOG" >&2; exit 1; fi
  sleep 0.5
done
echo "question: $PROMPT"
specmesh generate "$PROMPT" --max-tokens 64
