#!/usr/bin/env bash
# The demo (README.md): set up the environment, train the demo model pair once (cached afterwards),
# generate with it offline — plainly, then with speculative decoding (the draft model, then n-gram
# lookup; greedy output is identical; acceptance rates are printed) — then serve it: start `tidepool serve`, stream
# a completion, print metrics, stop cleanly.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
echo "== the demo model pair (trained on the first run: up to ~70 min on 2 cores; cached afterwards)"
models="$(bash scripts/demo_models.sh)"
target="$(sed -n 1p <<<"$models")"
draft="$(sed -n 2p <<<"$models")"
prompts=(--prompt $'import os\nimport sys\n\n\ndef main(' --prompt $'class Queue:\n    """' --prompt $'    def __init__(self, ')
echo "== offline generation (tidepool generate; sampled: temperature 0.7, top-p 0.9)"
(cd /tmp && tidepool --log-level WARNING generate --model "$target" --max-tokens 48 --temperature 0.7 --top-p 0.9 \
  --seed 1 "${prompts[@]}")
greedy=(--prompt $'import os\nimport sys\n\n\ndef main(' --prompt $'    def __init__(self, ')
echo
echo "== greedy, plain"
(cd /tmp && tidepool --log-level WARNING generate --model "$target" --max-tokens 48 "${greedy[@]}")
echo
for config in "{\"method\": \"draft\", \"draft_model\": \"$draft\", \"num_speculative_tokens\": 4}" \
              '{"method": "ngram", "num_speculative_tokens": 4}'; do
  echo "== greedy with speculative decoding $config (identical text; acceptance rate below)"
  (cd /tmp && tidepool --log-level WARNING generate --model "$target" --max-tokens 48 "${greedy[@]}" \
    --speculative-config "$config")
  echo
done
exec bash "$TIDEPOOL_ROOT/scripts/serve_demo.sh"
