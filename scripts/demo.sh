#!/usr/bin/env bash
# The demo (README.md): set up the environment, make a small random model, generate with it offline,
# then serve it: start `tidepool serve`, stream a chat completion, print metrics, stop cleanly.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
model="$(demo_model)"
echo "== offline generation (tidepool generate)"
(cd /tmp && tidepool generate --model "$model" --max-tokens 24 \
  --prompt "Once upon a time" --prompt "The capital of France is" --prompt "def fibonacci(n):")
echo
exec bash "$TIDEPOOL_ROOT/scripts/serve_demo.sh"
