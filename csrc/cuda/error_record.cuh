// Writing and reading the ErrorRecord (call_params.h) on the device: the one rule every kernel
// follows instead of trapping. Inline and without printf, since the fused kernels that include it
// must contain no function call (gpu_context.cuh).
#pragma once

#include "call_params.h"

namespace comet::gpu {

// Claims the record for `code`: true for the one caller that then fills it. The first failure
// wins; a failure (fails_call) also replaces a report still waiting there (a row overflow or a
// rejection of an earlier call without host synchronisation), because only the failure stops
// this call's kernels from publishing to the peers.
static __device__ __forceinline__ bool claim_error(ErrorRecord* e, int32_t code) {
  if (e == nullptr) return false;
  int* c = reinterpret_cast<int*>(&e->code);
  int seen = atomicCAS(c, 0, code);
  while (seen != 0 && fails_call(code) && !fails_call(seen)) {
    const int prev = atomicCAS(c, seen, code);
    if (prev == seen) return true;
    seen = prev;
  }
  return seen == 0;
}

// Whether this call failed on this rank (a failure code is recorded; volatile: mapped host
// memory another block may have written): its waits return at once and it publishes nothing more.
static __device__ __forceinline__ bool call_failed(const ErrorRecord* e) {
  return e != nullptr && fails_call(*reinterpret_cast<const volatile int32_t*>(&e->code));
}

}  // namespace comet::gpu
