// Paged attention on the CPU, reading Tidepool's KV cache in place.
//
// One call serves a whole step: every sequence's queries (one for a decode, a chunk for a prefill,
// several for speculative verification) attend to that sequence's cached keys through its block
// table, causally (query t of a sequence with context L and n new tokens sits at position
// L - n + t) and within the sliding window when one is set (keys (pos - window, pos]).
//
// The step is cut into tiles (plan.h), claimed dynamically by the threads, largest first; what a
// tile does is in attention_run.h (shared with decoder.cpp).
//
// Threads: an OpenMP parallel region with the caller's thread count. The build links the OpenMP
// runtime torch itself loaded, so this region and torch's ops share one thread pool.
#include <algorithm>
#include <atomic>
#include <new>
#include <vector>

#include "attention_run.h"

namespace tidepool {
namespace {

template <typename T>
void run(const Args& a, const Plan& p, float* parts) {
  const int num_threads = std::max(1, std::min<int>(a.num_threads, int(p.items.size())));
  // Allocated here, where a failure can still be reported: nothing inside the region allocates.
  std::vector<Scratch> scratch;
  scratch.reserve(num_threads);
  for (int t = 0; t < num_threads; ++t) scratch.emplace_back(a.head_dim, p.state_rows);
  std::atomic<size_t> next_scratch{0}, next_item{0}, next_merge{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    Scratch& sc = scratch[next_scratch.fetch_add(1, std::memory_order_relaxed)];
    for (size_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < p.items.size();)
      run_item<T>(a, p.items[i], sc, parts);
    if (!p.merges.empty()) {
#pragma omp barrier
      for (size_t i; (i = next_merge.fetch_add(1, std::memory_order_relaxed)) < p.merges.size();)
        run_merge<T>(a, p.merges[i], parts, sc);
    }
  }
}

}  // namespace
}  // namespace tidepool

extern "C" {

// Bumped whenever TpAttentionArgs or the meaning of a field changes; the loader checks it.
TP_EXPORT int tp_abi_version() { return 1; }

TP_EXPORT int tp_args_size() { return int(sizeof(TpAttentionArgs)); }

TP_EXPORT int tp_supports_dtype(int32_t dtype) {
  return dtype == 0 || dtype == 1 || (dtype == 2 && TIDEPOOL_HAS_F16);
}

// Returns 0, or an Error code (out untouched) for arguments that do not describe a valid step or when
// the working memory cannot be allocated.
TP_EXPORT int tp_paged_attention(const TpAttentionArgs* args) {
  using namespace tidepool;
  const TpAttentionArgs& a = *args;
  if (!tp_supports_dtype(a.dtype)) return BAD_DTYPE;
  if (const int err = validate(a)) return err;
  try {  // no C++ exception may cross the C boundary
    const Plan p = plan(a);
    std::vector<float> parts(static_cast<size_t>(p.parts_size));
    switch (a.dtype) {
      case 0:
        run<float>(a, p, parts.data());
        break;
      case 1:
        run<bf16>(a, p, parts.data());
        break;
#if TIDEPOOL_HAS_F16
      case 2:
        run<f16>(a, p, parts.data());
        break;
#endif
      default:
        return BAD_DTYPE;
    }
  } catch (const std::bad_alloc&) {
    return OUT_OF_MEMORY;
  }
  return OK;
}

}  // extern "C"
