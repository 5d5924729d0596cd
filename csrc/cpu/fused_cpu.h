// The CPU backend's fused layers without torch: what runs after the call protocol agreed on a call
// (SymmHeap::begin_call returned its epoch). Both layers run the engine's prologue programs and
// comm programs (csrc/include/comet/) on grids of thread teams (block_runner.h), the GEMM tiles by
// tile_gemm.h. ops_cpu.cpp wraps them for torch.ops.comet; the C++ tests (and the ThreadSanitizer
// build) call them directly. Callers own every buffer; sizes are stated per field.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "comet/activation.h"
#include "comet/fp8_rows.h"
#include "comet/numeric.h"
#include "comet/tile_order.h"
#include "symm_heap.h"

namespace comet::cpu {

struct CpuLaunch {
  int32_t n_comm, n_gemm;   // comm / GEMM blocks (n_gemm >= 1; n_comm = 0: a staged layer of
                            // n_gemm blocks, comet/block_roles.h)
  int32_t tile_m, tile_n;
  int32_t threads;          // OS threads per block
  uint64_t stress_seed;     // nonzero: random delays in every thread (cpu_context.h)
  int32_t band_n = 1;       // layer1: n-tiles per column band (tile_order.h), 0 = all
  int32_t resident = 0;     // blocks live at once, as on a GPU (block_runner.h); 0: all
                            // (the device's slots less the call's sm_margin)
  int32_t raster_group = 0; // m-tiles per raster group of the tile orders (tile_order.h); 0: auto
  DeviceSlots device;       // the rank's pool of resident-block slots (none when unlimited)
};

struct Layer0Problem {
  const void* x;        // [T, H] this rank's tokens
  const void* w0;       // [E_local, N0, H] this rank's experts ([E_local, H, N0] if w0_transposed)
  const int32_t* ids;   // [T, k] expert ids, -1 = dropped slot (already validated)
  ScalarKind kind;      // of x, w0 and the outputs
  int64_t tokens, hidden, n0;
  int32_t experts, topk;
  bool w0_transposed = false;
  const void* b0 = nullptr;  // [E_local, N0] (kind), or none
  int32_t tp = 1;            // tp_size (comet/layout.h): E_local = E / (W / tp), w0 the rank's shard
  bool dedup = true;         // a token crosses once per destination rank (comm_layer0.h); false:
                             // once per slot (tests compare the two bit for bit)
  // FP8 (comet/fp8_rows.h). kind F8E4M3: x holds packed rows [T, fp8_row_bytes(H)] (values and
  // their 1 x 128 scales, moved as one row). w_kind / out_kind: of w0 and of y0 (and b0) when they
  // differ from kind; F8E4M3 weights come with w0_scale [E_local, ceil(N0/128), ceil(H/128)].
  std::optional<ScalarKind> w_kind, out_kind;
  const float* w0_scale = nullptr;
  // The activation fused into the GEMM's epilogue (comet/activation.h): y0 is then h [M, out_cols()].
  Activation activation = Activation::None;
  // With an activation: h emitted as FP8 packed rows [M, fp8_row_bytes(out_cols())] (values and
  // their 1 x 128 scales, comet/fp8_rows.h), quantised in the epilogue from the fp32 values.
  bool h_fp8 = false;
  ScalarKind weight_kind() const { return w_kind.value_or(kind); }
  ScalarKind output_kind() const { return out_kind.value_or(kind); }
  int64_t out_cols() const { return activation_cols(activation, n0); }
  int64_t row_bytes() const {  // of a token row in x, on the wire and in a
    return kind == ScalarKind::F8E4M3 ? fp8_row_bytes(hidden) : hidden * scalar_bytes(kind);
  }
};

// layer0 in two steps, because the caller allocates outputs sized by the dispatched row count.
class Layer0Call {
 public:
  // Publishes this rank's send plan and tokens, waits for every source's, builds the dispatch
  // layout and the tile plan. Writes send_pos [T*k] and recv_counts [W*E_local].
  Layer0Call(SymmHeap& heap, uint64_t epoch, const Layer0Problem& p, const CpuLaunch& l,
             int32_t* send_pos, int32_t* recv_counts);
  int64_t rows() const { return rows_; }  // M
  // The largest M of any rank of the group (every rank computes the same value from the send
  // plans all sources published), so a bound on it is checked alike everywhere.
  int64_t max_rows_of_group() const;
  // The fused kernel: rows into a [M, H], y0 [M, N0] = a @ w0[e]^T per expert (or its activation,
  // [M, out_cols()]), each row's origin.
  void run(void* a, void* y0, int32_t* row_source, int32_t* row_token, int32_t* row_slot);

 private:
  SymmHeap& heap_;
  uint64_t epoch_;
  Layer0Problem p_;
  CpuLaunch l_;
  int64_t rows_ = 0;
  std::vector<int64_t> expert_off_, seg_off_, order_;
  std::vector<MTile> mtiles_;
  std::vector<const char*> sources_;  // where each source's published region is read
  std::vector<uint64_t*> rows_ready_; // sources on other nodes: their rows are in the mirror
};

template <class Acc>
struct Layer1Problem {
  const void* h;              // [M, N1] dispatched rows after the activation
  const void* w1;             // [E_local, H, N1] ([E_local, N1, H] if w1_transposed)
  const Acc* weights;         // [T, k] top-k weights in the accumulator type
  const int32_t* ids;         // [T, k]
  const int32_t* send_pos;    // [T, k] from layer0
  const int32_t* recv_counts; // [W, E_local] from layer0
  ScalarKind kind;            // of h, w1 and out
  int64_t tokens, rows, n1, hidden;
  int32_t experts, topk;
  bool w1_transposed = false;
  const void* b1 = nullptr;  // [E_local, H] (kind), or none (added by tp rank 0 only)
  int32_t tp = 1;            // tp_size (comet/layout.h): w1 and h are the rank's N1 shard
  // FP8 (comet/fp8_rows.h): h of kind F8E4M3 with h_scale [rows of h, ceil(N1/128)]; w_kind /
  // out_kind: of w1 and of out (and b1, and the partials on the wire) when they differ from kind;
  // F8E4M3 weights come with w1_scale [E_local, ceil(H/128), ceil(N1/128)].
  std::optional<ScalarKind> w_kind, out_kind;
  const float* h_scale = nullptr;
  const float* w1_scale = nullptr;
  ScalarKind weight_kind() const { return w_kind.value_or(kind); }
  ScalarKind output_kind() const { return out_kind.value_or(kind); }
};

// layer1: publishes routing, builds the reduce plan from every peer's, runs the fused kernel.
// c [M, H] is the caller's scratch for the GEMM output; out [T, H] in p.kind. Throws
// std::invalid_argument when the peers' routing does not match the layout (rows).
template <class Acc>
void layer1_call(SymmHeap& heap, uint64_t epoch, const Layer1Problem<Acc>& p, const CpuLaunch& l,
                 Acc* c, void* out);

// Largest token count any rank announced for the current call (sizes the data regions).
int64_t max_tokens(const SymmHeap& heap);

}  // namespace comet::cpu
