// CUDA kernels of torch.ops.comet.moe_layer0 / moe_layer1 (the CUDA dispatch key). Per call:
//
//   host:    local checks (shapes, dtypes, devices, launch shape, co-residency) -- a failure still
//            takes part in the metadata exchange, so every rank raises instead of waiting
//   begin:   (device) call counter, buffer-reuse wait, routing validation, send plan, metadata
//            exchange, verdict, dispatch layout and M (prologue.cu)
//   eager:   ONE host read (the call summary: verdict, M, every rank's token count), then the
//            buffer grows collectively if a rank has more tokens than it holds
//   copies:  this rank's source data into its data segment (copy engine, stream-ordered)
//   publish: (device) announce the data, m-tiles and their order / the reduce plan
//   fused:   the persistent kernel: n_comm comm blocks + n_gemm GEMM blocks, laid out by
//            comet/block_roles.h (sm_90a TMA/wgmma or sm_80 cp.async/mma.sync path)
//
// With max_rows (the ops' argument, else the buffer's setting: comet.buffers.symm_cuda.Buffer.capturable)
// nothing reads back: the row-indexed outputs hold max_rows rows (rows >= M unspecified,
// M = recv_counts.sum()), layer1's h has max_rows rows, the ops are CUDA-graph capturable, and
// errors found on the device are reported by the next call or by Buffer.check().
//
// Optional operands: the expert biases b0 / b1 are added in the fused kernels' GEMM epilogue
// (epilogue.cuh); transposed weights (w0_transposed / w1_transposed) are read in place by both
// paths (their MN-major B instantiations): no per-call copy.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>

#include "call_verdict.h"
#include "comet/capture_rule.h"
#include "comet/block_roles.h"
#include "comet/exec_context.h"
#include "comet/layout.h"
#include "comet/symm_layout.h"
#include "comet/fp8_rows.h"
#include "cuda_buffer.h"
#include "launch.h"
#include "op_checks.h"
#include "proxy.h"
#include "proxy_session.h"

namespace comet::gpu {

// Text of what the device recorded (empty when nothing). Used by buffer_check too.
std::string describe_error(const ErrorRecord& e) {
  std::ostringstream m;
  switch (e.code) {
    case 0: return {};
    case kErrTimeout:
      m << "comet: rank " << e.rank << " (block " << e.block << ") gave up after " << e.seconds
        << " s waiting for " << wait_site_name(WaitSite(e.site)) << " (index " << e.index
        << ", call " << e.epoch << ", the flag held " << e.seen
        << "); a peer may have died, stalled, or called a different op (timeout set by "
           "COMET_TIMEOUT or Buffer(timeout=...)); every rank of the group calls "
           "Buffer.recover() to use this buffer again";
      break;
    case kErrRowsOverflow:
      m << "comet.moe_layer0: rank " << e.rank << " received " << e.index
        << " rows in call " << e.epoch << " but max_rows is " << e.limit
        << "; that call's outputs on this rank are invalid (raise max_rows)";
      break;
    case kErrWorkspace:
      if (Workspace(e.site) == Workspace::MTiles)
        m << "comet: rank " << e.rank << " call " << e.epoch << ": the m-tile plan holds "
          << e.index << " tiles, more than its workspace of " << e.limit
          << " (a bug of comet: no input should reach it)";
      else
        m << layout_mismatch_message(e.rank, e.index, Workspace(e.site) == Workspace::PlanEntries,
                                     e.limit)
          << " (call " << e.epoch << ")";
      m << "; every rank of the group calls Buffer.recover() to use this buffer again";
      break;
    case kErrRejected:
      m << "comet: call " << e.epoch << " (without host synchronisation) was rejected: ";
      if (e.index >= 0)
        m << "rank " << e.index << ": " << e.message;
      else
        m << "ranks disagree on the call (op, shapes, dtype, max_rows or group), or their "
             "layer1 layouts do not match the routing";
      break;
    case kErrRingFull:
      m << "comet: rank " << e.rank << " (block " << e.block << ") gave up after " << e.seconds
        << " s waiting for room in its inter-node put ring (a put to rank " << e.index
        << ", ticket " << e.limit << ", the proxy had issued " << e.seen
        << "): the proxy kernel is not running or a remote peer stopped draining; the put was "
           "dropped; every rank of the group calls Buffer.recover() to use this buffer again";
      break;
    case kErrProxyIdle:
      m << "comet: rank " << e.rank << ": the inter-node proxy waited " << e.seconds
        << " s for a request or its stop (ring position " << e.seen << " of " << e.limit
        << "); the call's kernels stalled; every rank of the group calls Buffer.recover() to "
           "use this buffer again";
      break;
    case kErrBadPut:
      m << "comet: rank " << e.rank << " (block " << e.block << "): a put to rank " << e.index
        << " names memory outside this rank's symmetric header and data segment, or the buffer "
           "has no put ring (a bug of comet: no input should reach it); the put was dropped; "
           "every rank of the group calls Buffer.recover() to use this buffer again";
      break;
    case kErrStaleGraph:
      m << "comet: rank " << e.rank << ": "
        << stale_graph_message(uint64_t(e.index), uint64_t(e.limit));
      break;
    default: m << "comet: unknown device error " << e.code;
  }
  return m.str();
}

// Every kernel a call may launch on this device, loaded now: under CUDA's default lazy module
// loading a kernel's first launch loads it, and a load may synchronise the device; during a call
// across nodes that would wait for the proxy kernel, which spins until the call's end kernel,
// launched later by this same thread: a hang. A per-kernel attribute query forces the load
// without changing the process's loading mode.
// GPUs newer than every architecture comet compiles SASS for (sm_100, sm_120, ...) run the
// sm_80 path and the sm_89 FP8 kernels from their embedded PTX (comet_build.ptx_arch), compiled
// by the driver on first load; the sm_90a kernels and the -rdc inter-node proxy have no PTX.
bool newer_gpu(const cudaDeviceProp& prop) { return prop.major >= 10; }

void preload_kernels(int device) {
  const cudaDeviceProp& prop = *at::cuda::getDeviceProperties(device);
  std::vector<const void*> fused;
  for (int tm : kTileMs) {
    for (ScalarKind kind : {ScalarKind::BF16, ScalarKind::F16})
      for (bool b_mn : {false, true}) {
        fused.push_back(fused_sm80_layer0_info(kind, b_mn, tm).func);
        fused.push_back(fused_sm80_layer0_info(kind, b_mn, tm, true).func);  // fused activation
        fused.push_back(fused_sm80_layer0_info(kind, b_mn, tm, true, true).func);  // and h_fp8
        fused.push_back(fused_sm80_layer1_info(kind, b_mn, tm).func);
        if (prop.major == 9) {  // the sm_90a kernels have no image for other GPUs
          fused.push_back(fused_sm90_layer0_info(kind, b_mn, tm).func);
          fused.push_back(fused_sm90_layer0_info(kind, b_mn, tm, true).func);  // fused activation
          fused.push_back(fused_sm90_layer1_info(kind, b_mn, tm).func);
        }
      }
    // FP8 (one kernel per layer, tile and FP8 architecture; the sm_89 ones have only an sm_89
    // image and compute_89 PTX).
    if (prop.major == 9) {
      fused.push_back(fused_sm90_fp8_layer0_info(tm).func);
      fused.push_back(fused_sm90_fp8_layer1_info(tm).func);
    } else if ((prop.major == 8 && prop.minor == 9) || newer_gpu(prop)) {
      fused.push_back(fused_sm89_fp8_layer0_info(tm).func);
      fused.push_back(fused_sm89_fp8_layer0_info(tm, true).func);  // fused activation
      fused.push_back(fused_sm89_fp8_layer0_info(tm, true, true).func);  // and h_fp8
      fused.push_back(fused_sm89_fp8_layer1_info(tm).func);
    }
  }
  cudaError_t e = preload_prologue_kernels();
  if (e == cudaSuccess) e = preload_combine_kernel();
  if (e == cudaSuccess) e = preload_fp8_pack_kernel();
  if (e == cudaSuccess) e = preload_copies_kernel();
  // The proxy runs only across nodes, which a newer GPU refuses (plan_launch): not loaded there.
  if (e == cudaSuccess && !newer_gpu(prop)) e = preload_proxy_kernels();
  for (const void* f : fused) {
    cudaFuncAttributes a;
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, f);
  }
  TORCH_CHECK(e == cudaSuccess, "comet: loading comet's CUDA kernels failed on this sm_",
              prop.major * 10 + prop.minor, " GPU: ", cudaGetErrorString(e),
              " (this build has no kernel image or PTX for it: rebuild comet with "
              "COMET_CUDA_ARCHS naming its architecture, or including 80, whose PTX newer GPUs "
              "compile on first use)");
}

namespace {

// A CUDA call's checker: tensors on this buffer's GPU, values not read on the host (the begin
// kernel checks them).
Checker cuda_checker(const char* op, int dev) {
  return Checker(op, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(dev)),
                 /*read_values=*/false);
}

// A failure the device recorded in an earlier call without host synchronisation (`pending`, from
// buffer_or_throw) is reported by this rank once its current call is done, not by failing the
// current call: a failed call would be recorded in turn by the peers that run without host
// synchronisation, whose next call would fail the same way, and so on (the ranks would take turns
// failing). So a call that is fine runs everywhere, and this rank raises afterwards...
void raise_pending(const std::string& pending) {
  TORCH_CHECK_VALUE(pending.empty(), pending,
                    " (reported now; this call itself ran on every rank, its results are "
                    "discarded on this rank)");
}
// ... and a call that fails anyway carries the earlier failure in its message.
CheckResult with_pending(CheckResult r, const std::string& pending) {
  if (!pending.empty()) r.message += "; also, " + pending;
  return r;
}

// Checker::launch refuses any other tile than the ones these kernels are compiled for.
static_assert(kTileMs[0] == kCudaTileM && kTileMs[1] == kCudaSmallTileM &&
                  kTileN == kCudaTileN,
              "op_checks.h: kCudaTile*");

// Which fused kernel runs a call and with how many blocks.
struct LaunchPlan {
  int fp8 = 0;        // FP8 operands: the sm_90a (90) or sm_89 (89) FP8 kernels; 0: 16-bit
  bool sm90 = false;  // else the sm_80 path
  bool b_mn = false;  // B MN-major (transposed weights read in place), else K-major
  bool vec = false;   // sm_80 path: 16-byte operand copies
  int tile_m = kCudaTileM;  // the tile's rows (kTileMs): which instantiation runs
  int grid = 0;
  int n_gemm = 0;
  int sm_margin = 0;  // SMs every kernel of the call leaves free (docs/gpu.md, "SM margin")
  FusedKernelInfo info{};
};

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Whether the sm_90a path (TMA + wgmma) takes a GEMM of K inputs and n_out outputs per expert: a
// Hopper GPU, non-empty, K % 8 == 0 and 16-byte aligned operands (TMA's 16-byte strides and base;
// a == nullptr: layer0's A, allocated here). b_mn: B is a transposed weight read in place
// ([El, K, n_out], N contiguous), whose row stride is n_out: n_out % 8 == 0 too.
bool sm90_path(int device, int64_t k, int64_t n_out, const void* a, const void* b, bool b_mn) {
  const cudaDeviceProp& prop = *at::cuda::getDeviceProperties(device);  // cached by ATen
  return prop.major == 9 && k > 0 && n_out > 0 && k % 8 == 0 && (a == nullptr || aligned16(a)) &&
         aligned16(b) && (!b_mn || n_out % 8 == 0);
}

// Picks the path from the device and the operands (b: the weights as given, MN-major when b_mn:
// both paths read either layout in place), then sizes the grid
// from the occupancy API so that every block is co-resident on a GPU of its own (no block waits on
// a higher-index one, comet/block_roles.h, so fewer resident blocks, with another kernel beside
// it, slow the kernel down but cannot deadlock it); refuses a grid larger than that. proxy_sm: the buffer has peers on other nodes, so the inter-node
// proxy kernel (proxy.cu, one block) runs beside the fused kernel, which waits on what the proxy
// delivers (and on ring room the proxy frees): the fused grid leaves it one SM, since a fused
// block fills its SM's registers / shared memory and the proxy could not fit beside one.
// FP8 operands (kind F8E4M3; the shared checks made both operands FP8, K-major, bf16 out): the
// GPU's FP8 tensor cores pick the kernel: sm_90 the wgmma one (TMA: 16-byte rows, so K % 16 == 0,
// and 16-byte aligned operands), sm_89 the mma.sync one (any K); no FP8 tensor cores: refused.
bool plan_fp8(Checker& c, LaunchPlan& lp, const cudaDeviceProp& prop, int layer, int64_t k,
              const void* a, const void* b) {
  const int sm = newer_gpu(prop) ? 89 : prop.major * 10 + prop.minor;  // newer: sm_89's PTX
  if (!c.value(sm == 90 || sm == 89,
               "FP8 layers need FP8 tensor cores (sm_89 Ada, sm_90 Hopper, or newer); this GPU "
               "is sm_" + std::to_string(prop.major * 10 + prop.minor) +
                   ": pass bfloat16 operands (comet.fp8.dequantize_rows / "
                   "dequantize_blocks) or run FP8 on the CPU backend"))
    return false;
  if (sm == 90 &&
      !c.value(k % 16 == 0 && (a == nullptr || aligned16(a)) && aligned16(b),
               std::string("FP8 on sm_90 loads rows with TMA, which needs 16-byte rows: ") +
                   (layer == 0 ? "H" : "N1") + " = " + std::to_string(k) +
                   (k % 16 == 0 ? " and the operands must be 16-byte aligned"
                                : " is not a multiple of 16")))
    return false;
  lp.fp8 = sm;
  const int tm = lp.tile_m;
  lp.info = sm == 90
                ? (layer == 0 ? fused_sm90_fp8_layer0_info(tm) : fused_sm90_fp8_layer1_info(tm))
                : (layer == 0 ? fused_sm89_fp8_layer0_info(tm) : fused_sm89_fp8_layer1_info(tm));
  return true;
}

// device_ranks: ranks of the group on this GPU (CudaBuffer::device_ranks; W in the simulated
// world): the grid then uses at most its share of the SMs (CudaBuffer::sm_share), one block per
// SM, so that the W ranks' grids, which wait on each other, are all resident at once.
LaunchPlan plan_launch(Checker& c, int layer, ScalarKind kind, int device, int64_t k,
                       int64_t n_out, const void* a, const void* b, bool b_mn, int64_t n_comm,
                       int64_t n_gemm, int64_t tile_m, bool proxy_sm, int64_t sm_margin,
                       const CudaBuffer& buf) {
  LaunchPlan lp;
  if (c.failed()) return lp;
  lp.sm_margin = int(sm_margin);
  lp.tile_m = int(tile_m);  // kCudaTileM or kCudaSmallTileM (Checker::launch)
  const cudaDeviceProp& prop = *at::cuda::getDeviceProperties(device);  // cached by ATen
  const std::string sm = "sm_" + std::to_string(prop.major * 10 + prop.minor);
  if (!c.value(prop.major >= 8, "the CUDA kernels need sm_80 or newer (Ampere, Ada, Hopper; "
                                "newer GPUs through the sm_80 path's PTX); this GPU is " + sm))
    return lp;
  if (!c.value(!(newer_gpu(prop) && proxy_sm),
               "a group across nodes needs the inter-node proxy kernel, which is compiled for "
               "the build's architectures only (it has no PTX); this GPU is " + sm +
               ": rebuild comet with COMET_CUDA_ARCHS naming its architecture"))
    return lp;
  if (kind == ScalarKind::F8E4M3) {
    if (!plan_fp8(c, lp, prop, layer, k, a, b)) return lp;
  } else {
    // sm_80 path: 16-byte copies need 16-byte rows and bases; MN-major B's rows are n_out long.
    lp.vec = k % 8 == 0 && (a == nullptr || aligned16(a)) && aligned16(b) &&
             (!b_mn || n_out % 8 == 0);
    lp.sm90 = sm90_path(device, k, n_out, a, b, b_mn);
    lp.b_mn = b_mn;
    const int tm = lp.tile_m;
    lp.info = lp.sm90 ? (layer == 0 ? fused_sm90_layer0_info(kind, b_mn, tm)
                                    : fused_sm90_layer1_info(kind, b_mn, tm))
                      : (layer == 0 ? fused_sm80_layer0_info(kind, b_mn, tm)
                                    : fused_sm80_layer1_info(kind, b_mn, tm));
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, lp.info.func, lp.info.threads,
                                                    lp.info.smem_bytes) != cudaSuccess)
    per_sm = 0;
  // The SMs left to other kernels: sm_margin for whatever peers may wait on beside this call
  // (a collective, another buffer's call), and one more for the inter-node proxy. Several ranks
  // on this GPU: this rank's share, one block per SM (a block of any kernel fits on an SM no
  // other block holds, so the ranks' grids, together no more blocks than SMs, are co-resident).
  const bool shared = buf.device_ranks() > 1;
  const int own_sms = buf.sm_share(prop.multiProcessorCount);
  const int sms = own_sms - (proxy_sm ? 1 : 0) - int(sm_margin);
  if (shared) per_sm = std::min(per_sm, 1);
  const std::string whose = shared ? "this rank's share of this GPU's SMs (" +
                                         std::to_string(own_sms) + " = " +
                                         std::to_string(prop.multiProcessorCount) + " / " +
                                         std::to_string(buf.device_ranks()) + " ranks on it)"
                                   : "this GPU's " + std::to_string(prop.multiProcessorCount) +
                                         " SMs";
  if (!c.value(sms >= 1, "sm_margin=" + std::to_string(sm_margin) + " leaves none of " + whose +
                             " to the call" +
                             (proxy_sm ? " (one more is the inter-node proxy's)" : "")))
    return lp;
  const int64_t resident = int64_t(per_sm) * sms;
  std::ostringstream why;
  why << "this GPU's co-resident blocks of the fused kernel: " << per_sm << " per SM x " << sms
      << " SMs" << (shared ? " of " + whose : "")
      << (proxy_sm ? ", one SM left to the inter-node proxy" : "")
      << (sm_margin > 0 ? ", sm_margin=" + std::to_string(sm_margin) + " left free" : "")
      << "; the blocks wait on each other, so a larger grid could deadlock; n_gemm=0 uses "
         "every block n_comm leaves";
  // n_gemm = 0: every co-resident block n_comm leaves (at least one, or grid() refuses).
  if (!c.grid(n_comm, n_gemm == 0 ? std::max<int64_t>(resident - n_comm, 1) : n_gemm, resident,
              why.str()))
    return lp;
  const int64_t grid = n_gemm == 0 ? resident : n_comm + n_gemm;
  lp.grid = int(grid);
  lp.n_gemm = int(grid - n_comm);
  return lp;
}

// A call's sm_margin: its own, or -1 for the buffer's (Buffer(sm_margin=)).
int64_t call_margin(const CudaBuffer& b, int64_t sm_margin) {
  return sm_margin == -1 ? b.sm_margin() : sm_margin;
}

// The device decided that the call is rejected and which rank's input to name (bad_rank).
std::string verdict_message(const std::vector<CallMeta>& metas, int32_t rank, const char* op_name,
                            int32_t bad) {
  std::string v = call_verdict(metas.data(), int32_t(metas.size()), rank, bad, op_name);
  return v.empty() ? std::string(op_name) + ": the call was rejected" : v;
}

[[noreturn]] void raise(const CheckResult& r) {
  if (r.code == 2) TORCH_CHECK_TYPE(false, r.message);
  TORCH_CHECK_VALUE(false, r.message);
}

// The call's buffer. `pending` receives (and the device record drops) what the device recorded in
// earlier calls that nobody read back (calls without host synchronisation): the op reports it
// after its call (raise_pending / with_pending; raising here would skip the exchange and leave
// the peers waiting). A timed-out wait is different: the buffer refuses calls until every rank
// re-armed it (CudaBuffer::recover); one that cannot be re-armed (dead) refuses them for good.
std::shared_ptr<CudaBuffer> buffer_or_throw(int64_t handle, std::string* pending) {
  std::shared_ptr<CudaBuffer> b;
  try {
    b = find_cuda_buffer(handle);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  TORCH_CHECK(b->dead().empty(), "comet: this buffer cannot be used again: ", b->dead());
  const ErrorRecord& er = b->error_host();
  if (fails_call(er.code)) b->mark_broken(describe_error(er));
  TORCH_CHECK(b->broken().empty(), "comet: this buffer needs re-arming after a failed call (",
              b->broken(), "): every rank of the group calls Buffer.recover() (collective), "
              "then calls again");
  if (er.code != 0) {
    *pending = "an earlier call without host synchronisation failed: " + describe_error(er);
    b->clear_error();
  }
  return b;
}

// A buffer across nodes refuses to be captured in a CUDA graph (comet/capture_rule.h says why),
// before anything is enqueued; every rank captures the same calls, so every rank raises.
void refuse_capture_across_nodes(const CudaBuffer& b, cudaStream_t stream, const char* op,
                                 const std::string& pending) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    status = cudaStreamCaptureStatusNone;
  }
  const std::string why =
      capture_refusal(b.topology().nodes(), status == cudaStreamCaptureStatusActive);
  TORCH_CHECK_VALUE(why.empty(), op, ": ", why, with_pending(CheckResult{}, pending).message);
}

CallMeta make_meta(OpKind op, const CudaBuffer& b, int64_t num_experts, int64_t topk,
                   int64_t hidden, int64_t cols, int32_t dtype, int64_t tokens,
                   int64_t max_rows, const CheckResult& check, int64_t tp) {
  return make_call_meta(op, b.world(), b.group_hash(), num_experts, topk, hidden, cols, dtype,
                        tokens, max_rows, check, tp, b.call_tag());
}

// Expert tensor parallelism runs on one node (as on the CPU backend: the node-first routing and
// node-reduced partials of comet/topology.h are per rank, not per EP rank).
void check_tp_topology(Checker& c, const CudaBuffer& b, int64_t tp) {
  c.value(tp == 1 || b.topology().nodes() == 1,
          "tp_size=" + std::to_string(tp) + " > 1 needs a group on one node (this group spans " +
              std::to_string(b.topology().nodes()) + " nodes)");
}

// One workspace allocation per call, carved into 256-byte aligned pieces.
class Carver {
 public:
  template <class T>
  size_t take(T*& slot, int64_t count) {
    const size_t at = bytes_;
    bytes_ += (size_t(std::max<int64_t>(count, 1)) * sizeof(T) + 255) / 256 * 256;
    pieces_.push_back({reinterpret_cast<void**>(&slot), at});
    return at;
  }
  at::Tensor allocate(int device) {
    at::Tensor ws = at::empty({int64_t(bytes_)},
                              at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
    bind(ws);
    return ws;
  }
  // Points the slots at `ws` (what allocate() returned) again, e.g. after another carver that
  // shares some slots was allocated in between.
  void bind(const at::Tensor& ws) {
    char* base = static_cast<char*>(ws.data_ptr());
    for (auto& p : pieces_) *p.slot = base + p.offset;
  }

 private:
  struct Piece {
    void** slot;
    size_t offset;
  };
  std::vector<Piece> pieces_;
  size_t bytes_ = 0;
};

// Grid of a multi-block prologue kernel (prologue.cu): about 16 items per thread, at most one block
// per SM of the rank's share (its grid barrier needs every block resident; with several ranks on
// the GPU, every rank's), and the scratch its programs need for
// `keys` counting-sort keys. The inter-node proxy's one 32-thread block, when running, fits beside
// a prologue block on any SM (256 threads, ~60 registers, 4 KiB of shared memory).
int32_t prologue_blocks(int64_t items, const CudaBuffer& b, int sm_margin) {
  const int sms =
      b.sm_share(at::cuda::getDeviceProperties(b.device())->multiProcessorCount) - sm_margin;
  return int32_t(std::clamp<int64_t>(ceil_div(std::max<int64_t>(items, 1),
                                              int64_t(kPrologueThreads) * 16),
                                     1, std::max(sms, 1)));
}

void take_grid_scratch(Carver& c, CallParams& p, int32_t blocks, int32_t keys) {
  c.take(p.sort_counts, int64_t(keys) * blocks * kPrologueThreads);
  c.take(p.block_sum, blocks);
  c.take(p.scan_total, 1);
}

void check_cuda(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "comet: ", what, ": ", cudaGetErrorString(e));
}

// The call's bound on the dispatched rows, for both ops: the op's max_rows argument when given,
// else the buffer's setting (Buffer.max_rows / `with buf.capturable(max_rows=R)`), -1 = none.
// Only -1 means "not given": another negative argument is kept so that the op's checks reject it.
int64_t effective_max_rows(const CudaBuffer& b, int64_t max_rows_arg) {
  return max_rows_arg != -1 ? max_rows_arg : b.max_rows();
}

// p.max_rows of a call: a call this rank already rejects on the host raises right away, so its
// begin kernel must not also record the rejection for the next call / Buffer.check() (it does for
// max_rows >= 0, when the host reads nothing back); else the next call would fail on it again.
int64_t device_max_rows(int64_t max_rows, bool locally_ok) { return locally_ok ? max_rows : -1; }

// The weights are read in place in both layouts: the usual one (w0 [El, N0, H], w1 [El, H, N1]:
// K contiguous, B K-major) and the ops' transposed one (w0 [El, H, N0] / w1 [El, N1, H]:
// N contiguous, B MN-major, lp.b_mn), by the MN-major B instantiations of the sm_90a path
// (fused_sm90.cuh: TMA over [El, K, N] with per-expert bounds; needs N % 8 == 0) and of the
// sm_80 path (sm80_tile_gemm.cuh: ldmatrix.trans; any shape, 16-byte copies when N % 8 == 0).

// The data of an optional bias, or null.
const void* bias_ptr(const std::optional<at::Tensor>& b) {
  return b.has_value() && b->defined() ? b->data_ptr() : nullptr;
}

CallParams base_params(const CudaBuffer& b, OpKind op, int64_t num_experts, int64_t topk,
                       int64_t n_comm, const LaunchPlan& lp, int32_t num_ntiles,
                       int64_t max_rows, int32_t tp) {
  CallParams p{};
  p.rank = b.rank();
  p.world = b.world();
  p.tp = tp;
  p.num_experts = int32_t(num_experts);
  p.experts_local = b.world() > 0 ? int32_t(num_experts / (b.world() / tp)) : 0;
  p.topk = int32_t(topk);
  p.op = int32_t(op);
  p.headers = b.headers_table();
  p.datas = b.datas_table();
  p.topo = b.topology();
  p.ring = b.put_ring();
  p.state = b.state();
  p.error = b.error_device();
  p.timeout_ns = uint64_t(std::max(0.0, b.timeout()) * 1e9);
  p.generation = b.generation();
  p.segment_bytes = b.capacity();
  p.n_comm = int32_t(n_comm);
  p.n_gemm = lp.n_gemm;
  p.tile_m = lp.tile_m;
  p.tile_n = kTileN;
  p.mode = b.bench_mode();
  p.raster_group = int32_t(std::max<int64_t>(raster_group_setting(), 0));
  p.num_ntiles = num_ntiles;
  p.max_rows = max_rows;
  p.sm_margin = lp.sm_margin;
  return p;
}

// The checks and parameters both ops share once their shapes are known: a call with max_rows
// cannot grow the buffer, so its tokens must fit; then the per-call sizes of CallParams.
void check_fits(Checker& c, int64_t max_rows, int64_t tokens, int64_t tcap) {
  if (!c.failed() && max_rows >= 0)
    c.value(tokens <= tcap, "this call has " + std::to_string(tokens) +
                                " tokens but the buffer holds " + std::to_string(tcap) +
                                " for this shape; calls with max_rows cannot grow it: reserve "
                                "capacity first (Buffer.reserve / an eager call)");
}

// The symmetric regions' token-row geometry (hidden elements of elem bytes): layer0's packed FP8
// rows (comet/fp8_rows.h) travel as row_bytes 1-byte elements, as on the CPU backend.
struct RowGeometry {
  int64_t hidden;
  int32_t elem;
};
RowGeometry row_geometry(OpKind op, ScalarKind kind, int64_t hidden, int32_t elem) {
  if (op == OpKind::Layer0 && kind == ScalarKind::F8E4M3) return {fp8_row_bytes(hidden), 1};
  return {hidden, elem};
}

DataRegions regions_of(const CallParams& p, const NodeTopology& topo, int64_t tcap) {
  const RowGeometry g = row_geometry(OpKind(p.op), ScalarKind(p.kind), p.hidden, p.elem_bytes);
  return call_regions(topo, OpKind(p.op), std::max<int64_t>(tcap, 0), int32_t(g.hidden), p.topk,
                      p.num_experts, g.elem, 4, p.tp);
}

int64_t token_capacity(const CudaBuffer& b, OpKind op, ScalarKind kind, int64_t hidden,
                       int64_t k, int32_t num_experts, int32_t elem, int32_t tp) {
  const RowGeometry g = row_geometry(op, kind, hidden, elem);
  return b.token_capacity(op, g.hidden, int32_t(k), num_experts, g.elem, tp);
}

// out_kind: of y0 / out (FP8 calls write bfloat16).
void set_call_sizes(CallParams& p, OpKind op, ScalarKind kind, int32_t elem, bool ok,
                    int64_t tokens, int64_t hidden, int64_t cols, int64_t tcap, int64_t k,
                    int32_t num_experts, const NodeTopology& topo, ScalarKind out_kind) {
  p.kind = int32_t(kind);
  p.out_kind = int32_t(out_kind);
  p.elem_bytes = elem;
  p.tokens = ok ? tokens : 0;
  p.hidden = hidden;
  p.cols = cols;
  p.tcap = tcap;
  const RowGeometry g = row_geometry(op, kind, hidden, elem);
  p.row_bytes = g.hidden * g.elem;
  p.regions = regions_of(p, topo, tcap);
}

// The eager path's read-back: raises (on every rank alike) when the call was rejected, grows the
// buffer (collectively) when a rank has more tokens than it holds, with the inter-node proxy
// paused around it. Returns the summary.
CallSummary settle(CudaBuffer& b, CallParams& p, const CheckResult& local, const char* op_name,
                   cudaStream_t stream, ProxySession& proxy) {
  CallSummary s = b.read_summary(p.metas, stream);
  if (b.error_host().code != 0) {
    const std::string msg = describe_error(b.error_host());
    b.mark_broken(msg);
    TORCH_CHECK(false, msg);
  }
  if (s.state.status == int32_t(CallStatus::Rejected)) {
    launch_finish(p, stream);
    std::string v = verdict_message(s.metas, b.rank(), op_name, s.state.bad_rank);
    if (!local.ok())
      v = local.message;
    else
      v += local.message;  // empty, or an earlier call's failure (with_pending)
    if (local.code == 2) TORCH_CHECK_TYPE(false, v);
    TORCH_CHECK_VALUE(false, v);
  }
  const size_t need = regions_of(p, b.topology(), s.state.max_tokens).total;
  if (need > b.capacity()) {
    if (b.subgroup()) {  // growing would need every process of the NVSHMEM world
      launch_finish(p, stream);
      TORCH_CHECK_VALUE(false, op_name, ": this call needs ", need, " bytes of symmetric memory "
                        "per rank but the buffer of this subgroup holds ", b.capacity(),
                        "; a subgroup's buffer cannot grow during a call (nvshmem_malloc is "
                        "collective over every process): call buffer.reserve(tokens=..., ...) "
                        "on every process first, or create it with a larger capacity_bytes");
    }
    proxy.pause();
    try {
      b.grow(need, stream);
    } catch (const SegmentRefused& e) {  // every rank alike; the old segment is back
      p.datas = b.datas_table();
      p.ring = b.put_ring();
      p.generation = b.generation();
      p.segment_bytes = b.capacity();
      proxy.resume();
      launch_finish(p, stream);
      TORCH_CHECK(false, op_name, ": ", e.what());
    }
    p.datas = b.datas_table();
    p.ring = b.put_ring();
    p.generation = b.generation();  // the kernels after begin compare with the new segment's
    p.segment_bytes = b.capacity();
    proxy.resume();
  }
  return s;
}

// One copy (src) or clear (src null) of rows x width bytes into a call's CopyList
// (launch.h; one kernel for all of them, launch_copies).
void add_copy(CopyList& l, void* dst, const void* src, int64_t width, int64_t rows = 1,
              int64_t dst_pitch = 0, int64_t src_pitch = 0) {
  TORCH_CHECK(l.add(dst, src, width, rows, dst_pitch, src_pitch),
              "comet: more than ", CopyList::kMax, " device copies in one call (an internal error)");
}

// T packed FP8 rows (comet/fp8_rows.h) straight into the symmetric x region: the values q
// [T, H] and their scales [T, ceil(H/128)] land at their offsets of each row_bytes-long row (two
// strided copies, no staging tensor). The rows' padding bytes are not written: nothing reads them
// (the GEMM's A is H wide; the comm blocks copy them along unread).
void add_packed_rows(CopyList& l, char* dst, const at::Tensor& q, const at::Tensor& scale,
                     int64_t row_bytes) {
  const int64_t T = q.size(0), H = q.size(1);
  const int64_t scale_bytes = scale.size(1) * 4;
  add_copy(l, dst, q.data_ptr(), H, T, row_bytes, H);
  add_copy(l, dst + fp8_row_scales_at(H), scale.data_ptr(), scale_bytes, T, row_bytes,
           scale_bytes);
}

// The copies kernel writes into the data segment the call was launched with: it first compares
// that segment's generation with the device state's and writes nothing when they differ (a CUDA
// graph replayed after a grow: comet/capture_rule.h). An eager call's generation is always
// current, so the same kernel serves both.
void launch_call_copies(CopyList& l, const CallParams& p, cudaStream_t stream) {
  l.state = p.state;
  l.generation = p.generation;
  launch_copies(l, stream);
  check_cuda(cudaGetLastError(), "launching the copies kernel (source data, flag clears)");
}

void launch_fused(int layer, ScalarKind kind, const CallParams& p, const LaunchPlan& lp,
                  cudaStream_t stream) {
  if (lp.fp8 == 90) {
    if (layer == 0)
      launch_fused_sm90_fp8_layer0(p, lp.grid, stream);
    else
      launch_fused_sm90_fp8_layer1(p, lp.grid, stream);
  } else if (lp.fp8 == 89) {
    if (layer == 0)
      launch_fused_sm89_fp8_layer0(p, lp.grid, stream);
    else
      launch_fused_sm89_fp8_layer1(p, lp.grid, stream);
  } else if (lp.sm90) {
    if (layer == 0)
      launch_fused_sm90_layer0(kind, p, lp.b_mn, lp.grid, stream);
    else
      launch_fused_sm90_layer1(kind, p, lp.b_mn, lp.grid, stream);
  } else {
    if (layer == 0)
      launch_fused_sm80_layer0(kind, p, lp.b_mn, lp.vec, lp.grid, stream);
    else
      launch_fused_sm80_layer1(kind, p, lp.b_mn, lp.vec, lp.grid, stream);
  }
  check_cuda(cudaGetLastError(), "launching the fused kernel");
}

// A fused layer's launches (comet/block_roles.h): the fused kernel once, or, staged (n_comm = 0),
// twice on the whole grid, each time with one role only.
void launch_layer(int layer, ScalarKind kind, CallParams p, const LaunchPlan& lp,
                  cudaStream_t stream) {
  const int32_t n_comm = p.n_comm;
  for (int32_t s = 0; s < fused_steps(n_comm); ++s) {
    const FusedStep step = fused_step(layer, s, lp.grid, n_comm);
    p.n_comm = step.n_comm;
    p.n_gemm = step.n_gemm;
    launch_fused(layer, kind, p, lp, stream);
  }
}

using Layer0Result =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Layer0Result moe_layer0_cuda(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& topk_ids,
                             int64_t num_experts, int64_t buffer, int64_t n_comm, int64_t n_gemm,
                             int64_t tile_m, int64_t tile_n, const std::optional<at::Tensor>& b0,
                             bool w0_transposed, int64_t max_rows_arg, int64_t tp_size,
                             const std::optional<at::Tensor>& x_scale,
                             const std::optional<at::Tensor>& w0_scale,
                             std::optional<at::ScalarType> out_dtype, bool dispatch_fp8,
                             std::optional<c10::string_view> activation, bool h_fp8,
                             int64_t sm_margin) {
  std::string pending;
  auto buf = buffer_or_throw(buffer, &pending);
  CudaBuffer& b = *buf;
  const int dev = b.device();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  refuse_capture_across_nodes(b, stream, "comet.moe_layer0", pending);
  b.claim_stream(stream);  // one stream at a time (comet/stream_rule.h)
  const int32_t W = b.world();

  // Expert ids are checked on the device by the begin kernel (reading them here would sync).
  const int64_t max_rows = effective_max_rows(b, max_rows_arg);
  Checker c = cuda_checker("comet.moe_layer0", dev);
  check_layer0(c, {x, w0, topk_ids, num_experts, b0, w0_transposed, max_rows, tp_size, x_scale,
                   w0_scale, out_dtype, dispatch_fp8, activation_arg(activation), h_fp8},
               W, {n_comm, n_gemm, tile_m, tile_n, 1, call_margin(b, sm_margin)});
  // The fused activation (comet/activation.h) runs in the 16-bit kernels of both paths (sm_80,
  // sm_90a) and the sm_89 FP8 kernel, h_fp8 on the sm_80 path and sm_89 (h_fp8_epilogue.cuh);
  // the others (sm_90a FP8, h_fp8 on an sm_90 GPU) refuse it here (on every rank, before any
  // kernel) rather than ignore it, and comet.moe_layer0 applies it after the op there
  // (comet/layers/ops.py mirrors this rule). h_fp8's own checks are check_layer0's, as on the CPU.
  if (activation && !c.failed()) {
    const cudaDeviceProp& prop = *at::cuda::getDeviceProperties(dev);  // cached by ATen
    const std::string act = "activation='" + std::string(*activation) + "'";
    const std::string after = ": call comet.moe_layer0(activation=...), which applies it after "
                              "the op there";
    const int64_t n0 = w0_out(w0, w0_transposed);
    const bool fp8_call = is_fp8(x) || is_fp8(w0) || dispatch_fp8;
    c.value(!h_fp8 || prop.major != 9,
            "h_fp8=True is not fused into the sm_90a kernels yet (this GPU is sm_" +
                std::to_string(prop.major * 10 + prop.minor) + ")" + after) &&
        c.value(!fp8_call || prop.major != 9,
                act + " is not fused into the sm_90a FP8 kernel yet (this GPU is sm_" +
                    std::to_string(prop.major * 10 + prop.minor) + ")" + after) &&
        // FP8: each half of a gated tile within one 128-row weight scale block (fused_sm89_fp8.cuh)
        c.value(!fp8_call || !activation_gated(layer0_activation(activation)) || n0 % 128 == 0,
                act + " on the FP8 CUDA kernel needs F = N0 / 2 a multiple of 64 (each half of a "
                      "tile in one 128-row weight scale block), got N0 = " + std::to_string(n0) +
                    after);
  }
  check_tp_topology(c, b, tp_size);
  const bool shaped = !c.failed();
  const Activation act = shaped ? layer0_activation(activation) : Activation::None;
  const int32_t tp = shaped ? int32_t(tp_size) : 1;
  const int64_t T = shaped ? x.size(0) : 0, H = shaped ? x.size(1) : 0;
  const int64_t N0 = shaped ? w0_out(w0, w0_transposed) : 0, k = shaped ? topk_ids.size(1) : 0;
  const int32_t E = shaped ? int32_t(num_experts) : W, El = E / (W / tp);
  // FP8 (the checks made both operands FP8): packed rows on the wire, bf16 y0.
  const bool fp8 = shaped && (is_fp8(x) || dispatch_fp8);
  const ScalarKind kind =
      fp8 ? ScalarKind::F8E4M3 : shaped ? scalar_kind(x.scalar_type()) : ScalarKind::BF16;
  const ScalarKind out_kind = fp8 ? ScalarKind::BF16 : kind;
  const int32_t elem = fp8 ? 1 : 2;
  // w0 read in place: [El, N0, H], or [El, H, N0] when transposed (MN-major B).
  const bool w_mn = shaped && w0_transposed;
  // h's columns (N0 without an activation); a gated form's MN-major B reads its up half F columns
  // into each k-row, so 16-byte copies there need F % 8 == 0 as well (plan_launch's n_out).
  const int64_t F = activation_cols(act, N0);
  LaunchPlan lp = plan_launch(c, 0, kind, dev, H, activation_gated(act) ? F : N0, nullptr,
                              shaped ? w0.data_ptr() : nullptr, w_mn, n_comm, n_gemm, tile_m,
                              b.multi_node(), call_margin(b, sm_margin), b);
  const bool h8 = shaped && h_fp8 && act != Activation::None;  // h as packed FP8 rows
  if (act != Activation::None && !c.failed())  // its own instantiation
    lp.info = lp.fp8 == 89 ? fused_sm89_fp8_layer0_info(int(tile_m), true, h8)
              : lp.sm90    ? fused_sm90_layer0_info(kind, lp.b_mn, int(tile_m), true)
                           : fused_sm80_layer0_info(kind, lp.b_mn, int(tile_m), true, h8);
  int64_t tcap = shaped ? token_capacity(b, OpKind::Layer0, kind, H, k, E, elem, tp) : 0;
  check_fits(c, max_rows, T, tcap);
  const CheckResult check = c.result();
  const bool ok = check.ok();

  const CallMeta me =
      make_meta(OpKind::Layer0, b, num_experts, k, H, N0, int32_t(kind), T, max_rows, check,
                tp_size);
  // n-tiles of h: a gated form's GEMM tile covers kTileN / 2 of its columns, with h_fp8 rounded
  // up to whole scale blocks (comet/activation.h, the CPU backend's rule too).
  const int64_t tile_h = activation_tile_cols(activation_gated(act) ? kTileN / 2 : kTileN, h8);
  CallParams p = base_params(b, OpKind::Layer0, ok ? E : W, ok ? k : 1, n_comm, lp,
                             int32_t(ceil_div(F, tile_h)), device_max_rows(max_rows, ok), tp);
  set_call_sizes(p, OpKind::Layer0, kind, elem, ok, T, H, N0, tcap, k, E, b.topology(), out_kind);
  p.activation = int32_t(act);
  p.h_fp8 = h8 ? 1 : 0;
  // FP8 x: its scales (contiguous now, while no proxy spins: it may allocate); packed into the
  // symmetric region below, with x's values. dispatch_fp8: x is quantised there, on the sending
  // side, by one kernel writing the packed rows (fp8_pack.cu).
  const at::Tensor fp8_scale = ok && is_fp8(x) ? x_scale->contiguous() : at::Tensor();

  at::Tensor ids32 = ok ? topk_ids.to(at::kInt).contiguous() : at::Tensor();
  p.ids = ok ? ids32.data_ptr<int32_t>() : nullptr;
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(at::kCUDA, dev);
  at::Tensor recv_counts = at::empty({W, std::max<int32_t>(El, 0)}, i32);
  at::Tensor send_pos = at::empty({T, k}, i32);
  p.recv_counts = recv_counts.data_ptr<int32_t>();
  p.send_pos = send_pos.data_ptr<int32_t>();
  Carver pre;
  pre.take(p.send_slot, T * k);
  pre.take(p.bucket, int64_t(E) + 1);
  pre.take(p.expert_off, int64_t(El) + 1);
  pre.take(p.seg_off, int64_t(El) * (W + 1));
  pre.take(p.metas, W);
  pre.take(p.sources, W);     // across nodes: begin's bucket-offset bases, then publish's bases
  pre.take(p.rows_ready, W);
  pre.take(p.order_bucket, int64_t(W) + 1);
  pre.take(p.small, int64_t(std::max(El, W)) + 1);
  p.source_blocks = prologue_blocks(T * k, b, p.sm_margin);
  take_grid_scratch(pre, p, p.source_blocks, std::max(E, W));
  at::Tensor ws_pre = pre.allocate(dev);

  // The per-call tensors of rows_cap rows (outputs, tile plan scratch), allocated while no proxy
  // spins: an allocation may call cudaFree (the caching allocator's retry), which synchronises
  // the device and would wait for a proxy that only ends with this call's end kernel.
  at::Tensor a, y0, row_source, row_token, row_slot, ws_post;
  Carver post;
  auto allocate_rows = [&](int64_t rows_cap) {
    p.rows_cap = rows_cap;
    p.mtiles_cap = ceil_div(rows_cap, p.tile_m) + El;
    const auto opts = x.options();
    // FP8: the packed rows (at least one: the TMA descriptor over them needs a row; narrowed to
    // rows_cap below), y0 in bfloat16.
    a = fp8 ? at::empty({std::max<int64_t>(rows_cap, 1), p.row_bytes}, opts.dtype(at::kByte))
            : at::empty({rows_cap, H}, opts);
    // h_fp8: h as packed FP8 rows (comet/fp8_rows.h), as the CPU op returns it; the kernel writes
    // every byte of the rows it computes, padding included.
    y0 = h8 ? at::empty({rows_cap, fp8_row_bytes(F)}, opts.dtype(at::kByte))
            : at::empty({rows_cap, F}, opts.dtype(fp8 ? at::kBFloat16 : x.scalar_type()));
    row_source = at::empty({rows_cap}, i32);
    row_token = at::empty({rows_cap}, i32);
    row_slot = at::empty({rows_cap}, i32);
    post.take(p.mtiles, p.mtiles_cap);
    post.take(p.mtile_order, p.mtiles_cap);
    p.plan_blocks = prologue_blocks(p.mtiles_cap, b, p.sm_margin);
    take_grid_scratch(post, p, p.plan_blocks, W);
    post.take(p.mtile_ready, p.mtiles_cap);  // cleared with the source data's copies below
    post.take(p.mtile_rows, p.mtiles_cap);
    ws_post = post.allocate(dev);
  };
  if (ok && max_rows >= 0) {  // known before the call: allocated before the proxy starts
    allocate_rows(max_rows);
    pre.bind(ws_pre);  // the source and begin kernels use the first workspace's grid scratch
  }

  launch_source(p, stream);
  check_cuda(cudaGetLastError(), "launching the source kernel");
  // From the begin kernel (metadata to other nodes) to the last kernel: the inter-node proxy runs
  // (a no-op on one node); it also ends on every exception below.
  ProxySession proxy(b, stream);
  launch_begin(p, me, stream);
  check_cuda(cudaGetLastError(), "launching the begin kernel");
  if (!ok) {
    launch_finish(p, stream);
    raise(with_pending(check, pending));
  }
  if (max_rows < 0) {
    const CallSummary s = settle(b, p, with_pending(check, pending), "comet.moe_layer0", stream, proxy);
    tcap = token_capacity(b, OpKind::Layer0, kind, H, k, E, elem, tp);
    p.tcap = tcap;
    p.regions = regions_of(p, b.topology(), tcap);
    // The rows are known only now: allocate with the proxy stopped (its end kernel is queued
    // behind the begin kernel, so a device synchronisation in the allocator completes).
    proxy.pause();
    allocate_rows(s.state.rows);
    proxy.resume();
  } else {
    post.bind(ws_post);  // the publish kernel's grid scratch
  }
  const int64_t rows_cap = p.rows_cap;
  p.a = static_cast<char*>(a.data_ptr());
  p.y0 = y0.data_ptr();
  p.w0 = w0.data_ptr();
  p.b0 = bias_ptr(b0);
  p.row_source = row_source.data_ptr<int32_t>();
  p.row_token = row_token.data_ptr<int32_t>();
  p.row_slot = row_slot.data_ptr<int32_t>();
  if (fp8) {  // A's values at the packed rows' start, their scales inside them (fp8_rows.h)
    p.a_ld = p.row_bytes;
    p.a_scale = reinterpret_cast<const float*>(p.a + fp8_row_scales_at(H));
    p.a_scale_ld = p.row_bytes / 4;
    p.w_scale = w0_scale->data_ptr<float>();
  }

  // This rank's source data into its data segment (after begin: peers are done with it), in
  // one kernel with the clearing of the fused kernel's m-tile flags and row counts. Those are
  // this rank's local workspace (ws_post, not symmetric memory: no peer can write them), and only
  // the fused kernel, queued after this kernel, reads or writes them (the source, begin and
  // publish kernels do not), so clearing them here rather than before the source kernel changes
  // nothing any kernel sees.
  char* own = b.own_data();
  CopyList copies;
  add_copy(copies, own + p.regions.bucket_off, p.bucket, int64_t(E + 1) * 4);
  add_copy(copies, own + p.regions.send_slot, p.send_slot, T * k * 4);
  // The routing and bucket positions: a destination fills a token's other slot rows from its
  // primary one (comm_layer0.h: dedup).
  add_copy(copies, own + p.regions.ids, p.ids, T * k * 4);
  add_copy(copies, own + p.regions.send_pos, p.send_pos, T * k * 4);
  p.dedup = layer0_dedup_setting() ? 1 : 0;
  b.traffic_row_bytes[0] = p.row_bytes;
  if (fp8 && is_fp8(x))
    add_packed_rows(copies, own + p.regions.x, x, fp8_scale, p.row_bytes);
  else if (!fp8)
    add_copy(copies, own + p.regions.x, x.data_ptr(), T * p.row_bytes);
  add_copy(copies, p.mtile_ready, nullptr, p.mtiles_cap * int64_t(sizeof(uint64_t)));
  add_copy(copies, p.mtile_rows, nullptr, p.mtiles_cap * int64_t(sizeof(uint32_t)));
  launch_call_copies(copies, p, stream);
  if (fp8 && !is_fp8(x))  // dispatch_fp8: quantised and packed on the way in
    launch_fp8_quantize_pack(x.data_ptr(), scalar_kind(x.scalar_type()), T, H,
                             own + p.regions.x, p.row_bytes, stream, p.state, p.generation);
  launch_publish(p, stream);
  check_cuda(cudaGetLastError(), "launching the publish kernel");

  // No rows: no TMA descriptor over A, so the sm_80 kernel runs (of the same B layout), with no
  // tile to compute (M = 0, or the call overflowed max_rows = 0 and skips its GEMM): it never
  // reads the weights.
  // (The FP8 kernels always run: their A has at least one row.)
  LaunchPlan run = lp;
  if (run.sm90 && rows_cap < 1) run.sm90 = false;
  if (!run.sm90 && lp.sm90) {
    run.info = fused_sm80_layer0_info(kind, lp.b_mn, lp.tile_m, act != Activation::None);
  }
  launch_layer(0, kind, p, run, stream);
  proxy.end();
  raise_pending(pending);
  return {y0, fp8 ? a.narrow(0, 0, rows_cap) : a, recv_counts, send_pos, row_source, row_token,
          row_slot};
}

at::Tensor moe_layer1_cuda(const at::Tensor& h, const at::Tensor& w1,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                           const at::Tensor& send_pos, const at::Tensor& recv_counts,
                           int64_t num_experts, int64_t buffer, int64_t n_comm, int64_t n_gemm,
                           int64_t tile_m, int64_t tile_n, const std::optional<at::Tensor>& b1,
                           bool w1_transposed, int64_t max_rows_arg, int64_t band_n,
                           int64_t tp_size,
                           const std::optional<at::Tensor>& h_scale,
                           const std::optional<at::Tensor>& w1_scale,
                           std::optional<at::ScalarType> out_dtype, int64_t sm_margin) {
  std::string pending;
  auto buf = buffer_or_throw(buffer, &pending);
  CudaBuffer& b = *buf;
  const int dev = b.device();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  refuse_capture_across_nodes(b, stream, "comet.moe_layer1", pending);
  b.claim_stream(stream);  // one stream at a time (comet/stream_rule.h)
  const int32_t W = b.world();

  // Expert ids and the layout's row count are checked on the device by the begin kernel.
  const int64_t max_rows = effective_max_rows(b, max_rows_arg);
  Checker c = cuda_checker("comet.moe_layer1", dev);
  check_layer1(c, {h, w1, topk_weights, topk_ids, send_pos, recv_counts, num_experts, b1,
                   w1_transposed, max_rows, tp_size, h_scale, w1_scale, out_dtype},
               W, {n_comm, n_gemm, tile_m, tile_n, band_n, call_margin(b, sm_margin)});
  check_tp_topology(c, b, tp_size);
  const bool shaped = !c.failed();
  const int32_t tp = shaped ? int32_t(tp_size) : 1;
  const int64_t T = shaped ? topk_ids.size(0) : 0, k = shaped ? topk_ids.size(1) : 0;
  // h's rows: M (the layout's row count) without a bound, max_rows with one (rows >= M unused);
  // only the begin kernel knows M. Everything sized here from h_rows is an upper bound.
  const int64_t h_rows = shaped ? h.size(0) : 0, N1 = shaped ? h.size(1) : 0;
  const int64_t H = shaped ? w1_out(w1, w1_transposed) : 0;
  const int32_t E = shaped ? int32_t(num_experts) : W, El = E / (W / tp);
  // FP8 (the checks made both operands FP8): h's scales beside it, out (and the partial rows on
  // the wire, elem) in bfloat16.
  const bool fp8 = shaped && is_fp8(h);
  const ScalarKind kind =
      fp8 ? ScalarKind::F8E4M3 : shaped ? scalar_kind(h.scalar_type()) : ScalarKind::BF16;
  const ScalarKind out_kind = fp8 ? ScalarKind::BF16 : kind;
  const int32_t elem = 2;
  // w1 read in place: [El, H, N1], or [El, N1, H] when transposed (MN-major B).
  const bool w_mn = shaped && w1_transposed;
  const LaunchPlan lp = plan_launch(c, 1, kind, dev, N1, H, shaped ? h.data_ptr() : nullptr,
                                    shaped ? w1.data_ptr() : nullptr, w_mn, n_comm, n_gemm,
                                    tile_m, b.multi_node(), call_margin(b, sm_margin), b);
  int64_t tcap = shaped ? token_capacity(b, OpKind::Layer1, kind, H, k, E, elem, tp) : 0;
  check_fits(c, max_rows, T, tcap);
  const CheckResult check = c.result();
  const bool ok = check.ok();

  const CallMeta me =
      make_meta(OpKind::Layer1, b, num_experts, k, H, N1, int32_t(kind), T, max_rows, check,
                tp_size);
  CallParams p = base_params(b, OpKind::Layer1, ok ? E : W, ok ? k : 1, n_comm, lp,
                             int32_t(ceil_div(H, kTileN)), device_max_rows(max_rows, ok), tp);
  set_call_sizes(p, OpKind::Layer1, kind, elem, ok, T, H, N1, tcap, k, E, b.topology(), out_kind);
  p.h_rows = h_rows;
  p.band_n = int32_t(band_n);  // checked: 0 .. INT32_MAX

  at::Tensor ids32 = ok ? topk_ids.to(at::kInt).contiguous() : at::Tensor();
  at::Tensor weights32 = ok ? topk_weights.to(at::kFloat).contiguous() : at::Tensor();
  p.ids = ok ? ids32.data_ptr<int32_t>() : nullptr;
  p.recv_counts = ok ? recv_counts.data_ptr<int32_t>() : nullptr;
  p.send_pos = ok ? send_pos.data_ptr<int32_t>() : nullptr;
  p.plan_cap = std::max<int64_t>(h_rows, 1);  // plan entries <= M <= h_rows
  p.mtiles_cap = ceil_div(h_rows, p.tile_m) + El;
  const int32_t NT = p.num_ntiles;
  Carver ws;
  ws.take(p.expert_off, int64_t(El) + 1);
  ws.take(p.seg_off, int64_t(El) * (W + 1));
  ws.take(p.metas, W);
  ws.take(p.plan_sources, W);
  ws.take(p.sources, W);  // across nodes (publish kernel)
  ws.take(p.rows_ready, W);
  // layer1_comm_args splits the entries into at most 4 chunks per comm block (comm_blocks.cuh).
  const int64_t chunks = 4 * std::max<int64_t>(comm_program_blocks(lp.grid, int32_t(n_comm)), 1);
  ws.take(p.chunk_done, chunks);
  ws.take(p.pair_off, int64_t(W) + 1);
  ws.take(p.pair_slot, T * k);
  ws.take(p.item_keys, T * k);
  ws.take(p.small, int64_t(std::max(El, W)) + 1);
  ws.take(p.order_bucket, int64_t(W) + 1);
  p.source_blocks = prologue_blocks(T * k, b, p.sm_margin);
  p.plan_blocks = prologue_blocks(h_rows, b, p.sm_margin);
  take_grid_scratch(ws, p, std::max(p.source_blocks, p.plan_blocks), W);
  ws.take(p.mtiles, p.mtiles_cap);
  ws.take(p.plan.entry_source, p.plan_cap);
  ws.take(p.plan.entry_token, p.plan_cap);
  ws.take(p.plan.entry_partial, p.plan_cap);
  ws.take(p.plan.entry_begin, p.plan_cap + 1);
  ws.take(p.plan.slot_row, p.plan_cap);
  ws.take(p.plan.slot_weight, p.plan_cap);
  ws.take(p.ntile_ready, NT);  // these three cleared with the source data's copies below
  ws.take(p.ntile_count, NT);
  at::Tensor ws_t = ws.allocate(dev);

  // Allocated before the proxy starts (as in layer0): their sizes are known now.
  at::Tensor cbuf = at::empty({h_rows, H}, h.options().dtype(at::kFloat));  // rows >= M unused
  at::Tensor out = at::empty({T, H}, h.options().dtype(fp8 ? at::kBFloat16 : h.scalar_type()));
  // FP8 with no rows: the TMA descriptor over h still needs one row to describe.
  at::Tensor h_stub = fp8 && h_rows < 1 ? at::zeros({1, std::max<int64_t>(N1, 16)},
                                                    h.options().dtype(at::kByte))
                                        : at::Tensor();

  launch_source(p, stream);
  check_cuda(cudaGetLastError(), "launching the source kernel");
  ProxySession proxy(b, stream);  // as in layer0
  launch_begin(p, me, stream);
  check_cuda(cudaGetLastError(), "launching the begin kernel");
  if (!ok) {
    launch_finish(p, stream);
    raise(with_pending(check, pending));
  }
  if (max_rows < 0) {
    settle(b, p, with_pending(check, pending), "comet.moe_layer1", stream, proxy);
    tcap = token_capacity(b, OpKind::Layer1, kind, H, k, E, elem, tp);
    p.tcap = tcap;
    p.regions = regions_of(p, b.topology(), tcap);
  }

  p.h = h_stub.defined() ? h_stub.data_ptr() : h.data_ptr();
  if (fp8) {  // h [h_rows, N1] with h_scale [h_rows, ceil(N1/128)]
    p.a_ld = N1;
    p.a_scale = h_scale->data_ptr<float>();
    p.a_scale_ld = scale_blocks(N1);
    p.w_scale = w1_scale->data_ptr<float>();
  }
  p.w1 = w1.data_ptr();
  p.b1 = adds_layer1_bias(p.rank, tp) ? bias_ptr(b1) : nullptr;  // once per (token, expert)
  p.c = cbuf.data_ptr<float>();
  p.out = out.data_ptr();

  char* own = b.own_data();
  // One kernel (as in layer0): the source data, and the fused kernel's column flags, their
  // arrival counters and the comm blocks' chunk counters cleared. Those three are this rank's
  // local workspace (ws_t, not symmetric memory: no peer can write them), read and written only
  // by the fused kernel, queued after this kernel (the source, begin and publish kernels do not
  // touch them), so clearing them here rather than before the source kernel changes nothing
  // any kernel sees.
  CopyList copies;
  add_copy(copies, own + p.regions.ids, p.ids, T * k * 4);
  add_copy(copies, own + p.regions.send_pos, p.send_pos, T * k * 4);
  add_copy(copies, own + p.regions.weights, weights32.data_ptr(), T * k * 4);
  add_copy(copies, own + p.regions.pair_off, p.pair_off, int64_t(W + 1) * 4);
  add_copy(copies, own + p.regions.pair_slot, p.pair_slot, T * k * 4);
  add_copy(copies, p.ntile_ready, nullptr, int64_t(NT) * int64_t(sizeof(uint64_t)));
  add_copy(copies, p.ntile_count, nullptr, int64_t(NT) * int64_t(sizeof(uint32_t)));
  add_copy(copies, p.chunk_done, nullptr, chunks * int64_t(sizeof(uint32_t)));
  launch_call_copies(copies, p, stream);
  b.traffic_row_bytes[1] = H * scalar_bytes(ScalarKind(p.out_kind));
  launch_publish(p, stream);
  check_cuda(cudaGetLastError(), "launching the publish kernel");

  // No rows: no TMA descriptor over h, so the sm_80 kernel runs, with no tile to compute (the
  // begin kernel rejects M > h_rows = 0): it never reads the weights, whatever their layout.
  LaunchPlan run = lp;
  if (run.sm90 && h_rows < 1) run.sm90 = false;
  launch_layer(1, kind, p, run, stream);
  launch_combine(p, run.grid, stream);
  check_cuda(cudaGetLastError(), "launching the combine kernel");
  proxy.end();
  raise_pending(pending);
  return out;
}

// A rank whose call fails before reaching an op kernel still takes part in the metadata
// exchange, so every peer raises too instead of waiting (comet.layers.ops' device checks use it).
std::string buffer_fail_call(int64_t handle, int64_t op, const std::string& message) {
  std::string pending;
  auto buf = buffer_or_throw(handle, &pending);
  CudaBuffer& b = *buf;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(b.device()));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  b.claim_stream(stream);
  const CheckResult check{1, message};
  const OpKind kind = op == 0 ? OpKind::Layer0 : OpKind::Layer1;
  const CallMeta me = make_meta(kind, b, b.world(), 1, 0, 0, -1, 0, -1, check, 1);
  CallParams p = base_params(b, kind, b.world(), 1, 1, LaunchPlan{}, 0, b.max_rows(), 1);
  p.regions = data_regions(kind, 0, 0, 1, b.world(), b.world(), 2, 4);
  Carver ws;
  ws.take(p.metas, b.world());
  at::Tensor ws_t = ws.allocate(b.device());
  ProxySession proxy(b, stream);
  launch_begin(p, me, stream);
  const CallSummary s = b.read_summary(p.metas, stream);
  launch_finish(p, stream);
  proxy.end();
  return verdict_message(s.metas, b.rank(), op == 0 ? "comet.moe_layer0" : "comet.moe_layer1",
                         s.state.bad_rank) +
         with_pending(CheckResult{}, pending).message;
}

}  // namespace

TORCH_LIBRARY_IMPL(comet, CUDA, m) {
  m.impl("moe_layer0", &moe_layer0_cuda);
  m.impl("moe_layer1", &moe_layer1_cuda);
}

TORCH_LIBRARY_FRAGMENT(comet_cuda, m) {
  m.def("buffer_fail_call(int handle, int op, str message) -> str", &buffer_fail_call);
}

}  // namespace comet::gpu
