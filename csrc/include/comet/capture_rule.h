// What a buffer's calls may do inside a CUDA graph (rules of the CUDA backend, kept free of CUDA
// types so the CPU tests check them; the CPU backend has no graphs).
//
// Stale replays. A captured call keeps the pointers of the data segment it was captured with
// (its kernels' parameters, its copies into the segment). A grow frees that segment and allocates
// a larger one, so replaying a graph captured before the grow would read and write freed memory.
// The buffer therefore numbers its segments: the generation starts at 0 and advances with every
// reallocation (CudaBuffer::grow, a failed grow's re-allocation of the old size included), and
// the device state holds the current one. Every call is launched with the generation it saw; the
// kernels that touch the segments first compare the two and, when they differ, record the stale
// replay and skip the call (the begin kernel marks it rejected, so the kernels after it skip
// theirs; a call copies its source data into the segment with a kernel that compares too,
// csrc/cuda/stream_copies.cu). Nothing reads back during a replay, so the error surfaces at the buffer's next eager
// call or Buffer.check().
//
// Captures across nodes. Across nodes the call's kernels need the inter-node proxy kernel to run
// concurrently on the buffer's proxy stream (csrc/cuda/proxy.h). In a graph the two become
// branches that CUDA may run one after the other, and then the fused kernels wait for puts that
// the proxy, queued behind them, never issues. So a call on a buffer that spans nodes is refused
// while its stream captures, before anything is enqueued.
#pragma once

#include <cstdint>
#include <string>

#include "comet/config.h"

namespace comet {

// A call launched with segment generation `launched` is stale once the buffer's is `current`.
COMET_HD bool stale_launch(uint64_t launched, uint64_t current) { return launched != current; }

// The generation after a reallocation of the data segment (a grow, or the old size allocated
// again after a grow that did not fit: either way new memory).
inline uint64_t next_generation(uint64_t generation) { return generation + 1; }

// The error of a stale replay: the segment's bytes at capture and now.
inline std::string stale_graph_message(uint64_t captured_bytes, uint64_t current_bytes) {
  return "a CUDA graph captured before the buffer grew from " + std::to_string(captured_bytes) +
         " to " + std::to_string(current_bytes) +
         " bytes was replayed (its calls were skipped on every rank, nothing was computed); "
         "recapture after reserve()";
}

// Empty when a call may run now; else why not: a buffer of `nodes` nodes while the calling stream
// `capturing` a CUDA graph.
inline std::string capture_refusal(int32_t nodes, bool capturing) {
  if (!capturing || nodes <= 1) return {};
  return "a buffer whose group spans " + std::to_string(nodes) +
         " nodes cannot be captured in a CUDA graph: its calls need the inter-node proxy kernel "
         "to run concurrently with them on the buffer's proxy stream, and a graph may run the two "
         "branches one after the other (a deadlock); run these calls eagerly";
}

}  // namespace comet
