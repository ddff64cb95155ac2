"""Multi-LoRA serving in the engine core (issue #37): many PEFT adapters on one base model, in one batch.

Modules (one job each):
- `types.py`: the torch-free public types (`LoRAError`, `LoRARequest`, `AdapterInfo`, `LoRASnapshot`).
- `peft.py`: `load_adapter` reads and validates a PEFT folder (adapter_config.json + safetensors) into
  host tensors, PEFT's per-module scaling folded into B. Pure: runs on any thread.
- `slots.py`: the device slots every projection site reads (`LoRASlots`, `SiteSlots`).
- `registry.py`: `LoRARegistry` (`LLMEngine.lora`): names and load ids, slot LRU, host LRU, the
  scheduler's gate, the thread-safe snapshot for metrics and /v1/models.
- `build.py`: `build_lora`, what `engine_builder` calls with `enable_lora`.
- `ops.py` (KERNELS): `lora_apply`, the one op every site calls.

Design:
- Data path (Punica / S-LoRA style). Each decoder layer's four projection sites (qkv, o, gate_up,
  down) run their base projection once for the whole batch, then `lora_apply` adds each token's
  adapter delta in place, `y[t] += B[s] (A[s] x[t])` with `s = slots[t]` (-1: base model). A site holds
  `A [S, J*R, in]` and `B [S, out, R]` (S = --max-loras, R = --max-lora-rank, J sub-targets fused in the
  site: q/k/v = 3, gate/up = 2); absent sub-targets and ranks below R are zero. The runner builds the
  per-token slots in stage 1 (`StepInputs.lora_slots`) only when a scheduled request has an adapter: a
  step without adapter tokens passes None and runs exactly as before (compiled one-call CPU decode,
  CUDA graph replay); a step with adapter tokens takes the per-layer path and never replays a graph.
- Slots and LRU. A request holds its adapter's slot while it is in the running batch (`acquire` when
  the scheduler admits it, `release` when it is preempted or finishes). An adapter needing a slot takes
  a free one, else the least recently used one no running request holds; so the running batch never
  mixes more than --max-loras adapters. Host copies (--max-cpu-loras, default --max-loras) are another
  LRU; an adapter evicted there is re-read from its folder by a background thread when needed (a
  failed re-read fails that adapter's waiting requests with its reason).
- Scheduler gate. A waiting request whose adapter cannot get a slot this step (none free, or its host
  copy still being read) is skipped, not blocking: base requests and requests of resident adapters
  behind it are still admitted. KV-cache admission keeps its head-of-line rule.
- Prefix cache key. A request's block-hash chain starts from its adapter's *load id* instead of None:
  no KV is shared across adapters or with the base model, and a reload under the same name (a new load
  id) never reuses the old weights' KV.
- Lifetime. `unregister` hides a name at once (new requests get 404 model_not_found); requests already
  added with it finish normally, and its slot is cleared when the last one finishes.
- Features. Chunked prefill and preemption need nothing more (per-token slots; release on preempt).
  Speculative decoding: the target verifies proposals with the adapters (the proposal tokens get the
  request's slot); a draft model's runner gets no slots (the draft ignores adapters). P/D: the KV
  hand-off carries `lora_name`; the decode engine must hold the adapter and refuses a request naming
  another one. Quantized base weights: the delta is added after the base `linear`, whatever its format.
  Tensor/pipeline parallelism: each rank's slots hold its stage's layers and its shard of every site,
  cut like the base weights (`distributed/lora_tp.py`); the driver's slot fills reach every rank as
  LORA_SLOT frames and each step's `lora_slots` travel on FORWARD.
"""
