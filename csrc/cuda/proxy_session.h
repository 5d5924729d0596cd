// The inter-node proxy's lifetime around one op call (proxy.h has the picture): constructed before
// the call's first kernel that may enqueue a put, ended after its last. A no-op on a buffer whose
// group is one node. Ends in its destructor too, so a call that raises half-way still stops its
// proxy and tells the peers on other nodes that it is done (they wait for that next call).
#pragma once

#include <cuda_runtime.h>

#include "cuda_buffer.h"

namespace comet::gpu {

class ProxySession {
 public:
  ProxySession(CudaBuffer& b, cudaStream_t main);
  ~ProxySession();
  ProxySession(const ProxySession&) = delete;
  ProxySession& operator=(const ProxySession&) = delete;

  bool running() const { return running_; }
  // Stream-ordered on the main stream: (send_done) this rank's "done with the call" to every peer
  // on another node, stop, and the main stream waits for the proxy's exit (after nvshmem_quiet).
  void end(bool send_done = true);
  // Around a collective grow of the data segment (nvshmem_malloc must not meet a running proxy;
  // the new proxy gets the new segment): pause() ends without "done", resume() starts again.
  void pause() { end(false); }
  void resume();

 private:
  void start();

  CudaBuffer& b_;
  cudaStream_t main_;
  cudaStream_t side_ = nullptr;
  bool running_ = false;
};

}  // namespace comet::gpu
