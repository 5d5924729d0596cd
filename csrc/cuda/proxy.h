// Host entry points of the inter-node transport's proxy (csrc/cuda/proxy.cu): the kernel that
// drains a buffer's put ring (put_ring.cuh) into NVSHMEM put-with-signal, and the kernel that
// ends it. Plain C++ (no NVSHMEM, no device code), for ops_cuda.cpp / proxy_session.cpp.
//
// Lifetime per op call on a buffer with peers on other nodes (ProxySession, proxy_session.h):
//   side stream:  [proxy ...................................... quiet, exit]
//   main stream:  begin .. publish .. fused .. combine .. [end]  ^ joins the side stream
// The proxy is launched on a side stream before the call's first kernel that may enqueue, and
// runs concurrently with them (one block of 32 threads: it fits beside a prologue block, and the
// fused kernels leave it one SM: plan_launch in ops_cuda.cpp). The end kernel, stream-ordered
// after every enqueuing kernel, sends this rank's "done with call e" to the peers on other nodes
// (header mailboxes) and asks the proxy to stop; the proxy drains what is left, calls
// nvshmem_quiet (every put of the call delivered) and exits; the main stream then waits for it,
// so the op's work ends with the transport idle. Such calls are never captured in a CUDA graph:
// the proxy must run concurrently with the fused kernels, which a graph's two branches do not
// promise (comet/capture_rule.h; the ops refuse the capture).
#pragma once

#include <cuda_runtime.h>

#include "call_params.h"

namespace comet::gpu {

struct ProxyParams {
  PutRing ring;
  const int32_t* pes;        // [world] device: NVSHMEM PE of each group rank
  int32_t world, rank;
  ErrorRecord* error;
  uint64_t idle_timeout_ns;  // neither a request nor the stop for this long: record, issue no more
};

struct ProxyEnd {
  PutRing ring;
  NodeTopology topo;
  int32_t rank;
  RankHeader* own_header;  // this rank's header (symmetric address): the Done mailbox flag
  const DeviceState* state;  // the call's epoch
  ErrorRecord* error;
  uint64_t timeout_ns;
  bool send_done;          // false: only stop (the call never ran its begin kernel)
};

void launch_proxy(const ProxyParams& p, cudaStream_t side);
void launch_proxy_end(const ProxyEnd& e, cudaStream_t main);
// Loads both kernels now (comet::gpu::preload_kernels).
cudaError_t preload_proxy_kernels();

// Threads of the proxy block: one warp (lane 0 issues; the others exit at once).
constexpr int kProxyThreads = 32;

}  // namespace comet::gpu
