// ProxySession (proxy_session.h): fork the proxy onto a side stream, join it back.
#include "proxy_session.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "proxy.h"

namespace comet::gpu {
namespace {

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "comet (inter-node proxy): ", what, ": ", cudaGetErrorString(e));
}

// `to` waits for everything queued on `from` so far (a fork or a join; capturable).
void order(cudaStream_t from, cudaStream_t to, const char* what) {
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what);
  cudaError_t e = cudaEventRecord(ev, from);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(to, ev, 0);
  cudaEventDestroy(ev);  // released once the wait no longer needs it
  check(e, what);
}

}  // namespace

ProxySession::ProxySession(CudaBuffer& b, cudaStream_t main) : b_(b), main_(main) {
  if (!b_.multi_node()) return;
  // The buffer's own high-priority stream (CudaBuffer::proxy_stream): a pooled stream of torch's
  // could be handed to other code, whose work would queue behind a proxy that spins until this
  // call's end kernel.
  side_ = b_.proxy_stream();
  start();
}

ProxySession::~ProxySession() {
  try {
    end(true);
  } catch (...) {
    // Already unwinding, or the CUDA context is gone: the buffer's error record says why.
  }
}

void ProxySession::start() {
  order(main_, side_, "forking the proxy stream");
  ProxyParams p{};
  p.ring = b_.put_ring();
  p.pes = b_.pes_device();
  p.world = b_.world();
  p.rank = b_.rank();
  p.error = b_.error_device();
  // Longer than any wait of the call's kernels (each bounded by the timeout), so a peer that
  // stalls is reported by the wait that saw it, not by an idle proxy.
  p.idle_timeout_ns = uint64_t(std::max(0.0, 2.0 * b_.timeout() + 1.0) * 1e9);
  launch_proxy(p, side_);
  check(cudaGetLastError(), "launching the proxy kernel");
  running_ = true;
}

void ProxySession::end(bool send_done) {
  if (!running_) return;
  running_ = false;
  ProxyEnd e{};
  e.ring = b_.put_ring();
  e.topo = b_.topology();
  e.rank = b_.rank();
  e.own_header = b_.own_header();
  e.state = b_.state();
  e.error = b_.error_device();
  e.timeout_ns = uint64_t(std::max(0.0, b_.timeout()) * 1e9);
  e.send_done = send_done;
  launch_proxy_end(e, main_);
  check(cudaGetLastError(), "launching the proxy's end kernel");
  order(side_, main_, "joining the proxy stream");
}

void ProxySession::resume() {
  if (side_ != nullptr && !running_) start();
}

}  // namespace comet::gpu
