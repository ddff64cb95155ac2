#!/usr/bin/env bash
# The demo (README.md): set up the environment, train the demo model pair once (cached afterwards),
# generate with it offline — plainly, then with speculative decoding from the draft model (greedy
# output is identical; the acceptance rate is printed) — then serve it: start `tidepool serve`, stream
# a completion, print metrics, stop cleanly.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
echo "== the demo model pair (trained on the first run: ~30-45 min on 2 cores; cached afterwards)"
models="$(bash scripts/demo_models.sh)"
target="$(sed -n 1p <<<"$models")"
draft="$(sed -n 2p <<<"$models")"
prompts=(--prompt $'import os\nimport sys\n\n\ndef main(' --prompt $'class Queue:\n    """' --prompt $'def fibonacci(n):\n')
echo "== offline generation (tidepool generate, greedy)"
(cd /tmp && tidepool --log-level WARNING generate --model "$target" --max-tokens 48 "${prompts[@]}")
echo
echo "== the same with speculative decoding: draft model (identical text)"
(cd /tmp && tidepool --log-level WARNING generate --model "$target" --max-tokens 48 "${prompts[@]}" \
  --speculative-config "{\"method\": \"draft\", \"draft_model\": \"$draft\", \"num_speculative_tokens\": 4}")
echo
exec bash "$TIDEPOOL_ROOT/scripts/serve_demo.sh"
