// Plain data shared by the host launchers (csrc/cuda/ops_cuda.cpp) and every CUDA kernel of one op
// call: the call's shape, where the symmetric memory and the per-buffer state live, the workspace
// the prologue kernels fill (dispatch layout, m-tiles, reduce plan) and the op's tensors.
//
// Everything the kernels need at run time is here or in device memory the prologue writes: no SM
// count, topk, expert count or tile count is a compile-time constant. Sizes that only the device
// knows when the caller passes max_rows (rows M, number of m-tiles, reduce-plan entries) live in
// DeviceState; the host only provides upper bounds (the *_cap fields) for the workspace.
#pragma once

#include "comet/exec_context.h"
#include "comet/gemm_schedule.h"
#include "comet/layout.h"
#include "comet/prologue.h"
#include "comet/reduce_plan.h"
#include "comet/symm_layout.h"
#include "comet/tile_order.h"
#include "comet/topology.h"
#include "put_ring.h"

namespace comet::gpu {

// Outcome of a call as decided on the device (DeviceState::status).
enum class CallStatus : int32_t {
  Ok = 0,
  Rejected = 1,      // some rank's input was bad or ranks disagree (every rank sees the same)
  RowsOverflow = 2,  // this rank received more rows than max_rows (local; reported later)
  Failed = 3,        // the publish kernel found its plans do not fit (ErrorRecord kErrWorkspace)
};

// Benchmark modes (comet.buffers.symm_cuda.Buffer.bench_mode): the fused kernels with either side idle
// but the readiness protocol intact, so the two sides' times can be measured apart.
enum class BenchMode : int32_t { Fused = 0, CommOnly = 1, GemmOnly = 2 };

// First failure on the device, in mapped pinned host memory, written by the kernel that found it
// (error_record.cuh: the first failure wins). No kernel traps: whatever a kernel finds, it records
// here and returns, so the CUDA context survives and the host raises the description.
struct ErrorRecord {
  int32_t code;     // 0 none, else one of the codes below
  int32_t site;     // WaitSite of a timeout; which workspace overflowed (kErrWorkspace)
  int32_t rank;     // rank that recorded it
  int32_t block;    // block that recorded it
  int64_t index;    // flag index of a timeout / offending count of an overflow / target rank /
                    //   the segment bytes a stale graph was captured with
  int64_t limit;    // bound of an overflow / ring ticket waited for / the segment's bytes now
  uint64_t epoch;   // call the wait belonged to
  uint64_t seen;    // last value the flag held
  double seconds;   // how long it waited
  char message[240];  // code 4: the rejecting rank's message (empty: ranks disagree)
};

// ErrorRecord codes (describe_error in ops_cuda.cpp words each; 5-7 are the inter-node
// transport's, put_ring.h).
constexpr int32_t kErrTimeout = 1;     // a wait timed out
constexpr int32_t kErrRowsOverflow = 2;  // this rank received more rows than max_rows (local)
constexpr int32_t kErrWorkspace = 3;   // a prologue plan outgrew its workspace (the layout does
                                       //   not match the peers' routing)
constexpr int32_t kErrRejected = 4;    // a call without host synchronisation was rejected
constexpr int32_t kErrStaleGraph = 8;  // a CUDA graph captured before the buffer grew was replayed

// Which part of the publish kernel's workspace overflowed (ErrorRecord.site of kErrWorkspace).
enum class Workspace : int32_t { MTiles = 0, PlanEntries = 1, PlanSlots = 2 };

// Whether a recorded code failed the call on this rank: its later waits return at once, it
// publishes nothing more to its peers (gpu_context.cuh: call_failed), and the buffer refuses
// calls until every rank re-armed it (CudaBuffer::recover). The other codes are reports: a
// row overflow (this rank skips its GEMM, its peers are unaffected), a rejection or a stale
// graph (every rank skipped the call alike) are raised by the next call or Buffer.check().
COMET_HD constexpr bool fails_call(int32_t code) {
  return code == kErrTimeout || code == kErrWorkspace || code == kErrRingFull ||
         code == kErrProxyIdle || code == kErrBadPut;
}

// Per-buffer device state, persistent across calls (device memory, zero-initialised once).
struct DeviceState {
  uint64_t epoch;         // call number, advanced on the device by each call's first kernel, so
                          // CUDA-graph replays count calls too
  uint32_t comm_done;     // comm blocks finished (self-resetting counter)
  uint32_t blocks_done;   // layer1 reduce-send arrivals (self-resetting counter)
  int32_t status;         // CallStatus of the current call
  int32_t bad_rank;       // first rank whose metadata failed the verdict (-1: disagreement)
  int64_t rows;           // M of the current call
  int64_t num_mtiles;
  int64_t plan_entries;   // layer1 reduce plan
  int64_t plan_slots;
  int64_t max_tokens;     // largest T over the ranks of the current call
  uint32_t grid_arrived;  // grid barrier of the multi-block prologue kernels (parallel.h)
  uint64_t grid_generation;
  unsigned long long first_bad_id;  // this call's first invalid expert id (slot index), or ~0
  unsigned long long routed_rows;   // this call's slots with an expert id (CallMeta.routed_rows)
  unsigned long long kernel_start;  // %globaltimer at the fused kernel's first block start
  unsigned long long kernel_end;    // ... and at its last warp's exit (reset by begin)
  // Buffer.traffic: rows the comm blocks pulled from other ranks in the last layer0 call and sent
  // to other ranks in the last layer1 call (the op's own count reset by begin)
  unsigned long long layer0_rows_received;
  unsigned long long layer1_rows_sent;
  // The data segment's generation (comet/capture_rule.h): advanced by every reallocation
  // (CudaBuffer::grow), with the segment's bytes; a call launched (captured) with another one
  // is stale.
  uint64_t generation;
  uint64_t segment_bytes;
};

struct CallParams {
  // group and call
  int32_t rank, world, num_experts, experts_local, topk;
  int32_t tp;             // tp_size (comet/layout.h): experts_local = E / (W / tp)
  int32_t op;             // OpKind
  int32_t kind;           // ScalarKind of x / h (and w0 / w1)
  int32_t elem_bytes;
  int64_t tokens;         // T on this rank
  int64_t hidden;         // H
  int64_t cols;           // N0 (layer0) / N1 (layer1)
  int64_t tcap;           // agreed token capacity of the data segment (strides of its regions)
  DataRegions regions;

  // symmetric memory (device arrays of W peer pointers from nvshmem_ptr) and per-buffer state
  RankHeader* const* headers;
  char* const* datas;
  DeviceState* state;
  ErrorRecord* error;
  uint64_t timeout_ns;
  // The data segment this call was launched (or captured) with: its generation and bytes
  // (compared with DeviceState's by the begin and publish kernels, comet/capture_rule.h).
  uint64_t generation;
  uint64_t segment_bytes;
  // Nodes of the group (comet/topology.h): peers on other nodes have null entries in headers /
  // datas and are reached through the put ring only (ring.slots null on one node).
  NodeTopology topo;
  PutRing ring;

  // launch
  int32_t n_comm, n_gemm, tile_m, tile_n;
  int32_t mode;           // BenchMode
  int32_t num_ntiles;     // ceil(N_out / tile_n): N_out = N0 (layer0) / H (layer1)
  int32_t band_n;         // layer1: n-tiles per column band (comet/tile_order.h), 0 = all
  int32_t sm_margin;      // SMs the grids that wait on themselves (prologue, combine) leave free
  int32_t raster_group;   // m-tiles per raster group of the tile orders (tile_order.h), 0 = auto
  int64_t rows_cap;       // rows the row-indexed outputs hold (M, or max_rows)
  int64_t max_rows;       // -1: rows known exactly (eager call)
  int64_t mtiles_cap;     // m-tile workspace bound
  int64_t plan_cap;       // reduce-plan workspace bound (entries and slots)

  // workspace (device, owned by the buffer)
  const int32_t* ids;     // [T*k] routing as int32
  int32_t* send_pos;      // [T*k]  layer0 output / layer1 input
  int32_t* send_slot;     // [T*k]  layer0 scratch: the send plan before it is published
  int32_t* bucket;        // [E+1]  layer0 scratch: bucket offsets of the send plan
  int32_t* pair_off;      // [W+1]  layer1 scratch: (token, destination) pairs before publishing
  int32_t* pair_slot;     // [T*k]
  int32_t* recv_counts;   // [W*El] layer0 output / layer1 input
  int64_t* expert_off;    // [El+1]
  int64_t* seg_off;       // [El*(W+1)]
  MTile* mtiles;          // [mtiles_cap]
  int64_t* mtile_order;   // [mtiles_cap]
  uint64_t* mtile_ready;  // [mtiles_cap] epoch-valued flags (layer0)
  uint32_t* mtile_rows;   // [mtiles_cap] layer0: rows written per m-tile (zeroed per call)
  int32_t dedup;          // layer0: a token crosses once per destination rank (comm_layer0.h)
  uint64_t* ntile_ready;  // [num_ntiles] epoch-valued flags (layer1)
  uint32_t* ntile_count;  // [num_ntiles] self-resetting counters (layer1)
  CallMeta* metas;        // [W] every rank's metadata of this call
  PlanSource<float>* plan_sources;  // [W] layer1: the peers' published routing
  // Across nodes (topology.h; set by the publish kernel, unused on one node):
  const char** sources;   // [W] where each source's published region is read (segment / mirror)
  uint64_t** rows_ready;  // [W] layer0: a remote source's MirrorRows flag on the relay, or null
  uint32_t* chunk_done;   // [4 * comm blocks] layer1: n-tiles reduced per chunk (zeroed per call;
                          //   comm blocks: comet/block_roles.h comm_program_blocks)
  ReducePlan<float> plan; // layer1: arrays of plan_cap (entries set on the device)

  // multi-block prologue kernels (prologue.h): grid sizes and their scratch
  int32_t source_blocks;  // grid of the source kernel (send plan / pair lists)
  int32_t plan_blocks;    // grid of the publish kernel (m-tiles, order, reduce plan)
  int32_t* sort_counts;   // [max(E, W) * max grid threads]
  int64_t* block_sum;     // [max grid blocks]
  int64_t* scan_total;    // [1]
  int32_t* item_keys;     // [T*k] layer1 pair keys
  int64_t* small;         // [max(El, W) + 1]
  int32_t* order_bucket;  // [W+1]

  // tensors
  char* a;                // layer0: [rows_cap, H] dispatched rows
  void* y0;               // layer0: [rows_cap, N0]
  const void* w0;         // layer0: [El, N0, H] (the kernel layout: K-contiguous)
  const void* b0;         // layer0: [El, N0] expert bias (x's dtype) or null; a tile of expert e
                          //   adds b0[e * N0 + col] to its fp32 accumulators before rounding
  int32_t* row_source;    // layer0: [rows_cap]
  int32_t* row_token;
  int32_t* row_slot;
  const void* h;          // layer1: [h_rows, N1]
  const void* w1;         // layer1: [El, H, N1] (the kernel layout: K-contiguous)
  const void* b1;         // layer1: [El, H] expert bias (h's dtype) or null; added to C (fp32),
                          //   so the comm blocks' top-k weighting applies to it as to the rest
  float* c;               // layer1: [h_rows, H] fp32 GEMM output
  void* out;              // layer1: [T, H]
  int64_t h_rows;         // layer1: rows of h (M, or max_rows)

  // Token rows on the wire and in a (layer0): H * elem_bytes, or fp8_row_bytes(H) for packed FP8
  // rows (comet/fp8_rows.h: the values, then their 1 x 128 scales, moved as one row).
  int64_t row_bytes;
  int32_t out_kind;       // ScalarKind of y0 and b0 (layer0) / of out and b1 (layer1)
  // layer0: the Activation fused into the epilogue (comet/activation.h; None: y0). With one, y0
  // is h [rows_cap, activation_cols(activation, cols)] and num_ntiles counts h's n-tiles (a
  // gated tile covers tile_n / 2 of h's columns, its GEMM tile_n columns through the B-row remap).
  int32_t activation;
  // layer0 with an activation: h leaves as packed FP8 rows (comet/fp8_rows.h) of
  // fp8_row_bytes(activation_cols) bytes, n-tiles of 128 h columns (activation_tile_cols).
  int32_t h_fp8;
  // FP8 GEMM operands (the FP8 kernels only: kind == F8E4M3; both operands FP8 on CUDA):
  //   A's values: layer0 the packed rows of a (row stride a_ld = row_bytes bytes), layer1 h
  //   (a_ld = N1); A's 1 x 128 block scales: row r, K block kb at a_scale[r * a_scale_ld + kb]
  //   (layer0: inside the packed rows, a_scale_ld = row_bytes / 4; layer1: h_scale,
  //   a_scale_ld = ceil(N1 / 128)); the weights' 128 x 128 block scales w_scale
  //   [El, ceil(N / 128), ceil(K / 128)] (N the GEMM's output columns, K its depth).
  int64_t a_ld;
  const float* a_scale;
  int64_t a_scale_ld;
  const float* w_scale;
};

// layer0's GEMM schedule (comet/gemm_schedule.h): the m-tiles in the comm blocks' order, each after
// its readiness flag; every sm path walks the same.
COMET_HD GemmScheduleArgs layer0_schedule_args(const CallParams& p, uint64_t epoch) {
  GemmScheduleArgs a{epoch,         p.mtiles,      p.state->num_mtiles, p.num_ntiles,
                     p.mtile_order, p.mtile_ready, nullptr,             nullptr};
  a.group = p.raster_group;
  return a;
}

// layer1's GEMM schedule (comet/gemm_schedule.h): every sm path and bench mode walks the same.
COMET_HD GemmScheduleArgs layer1_schedule_args(const CallParams& p, uint64_t epoch) {
  GemmScheduleArgs a{epoch,   p.mtiles, p.state->num_mtiles, p.num_ntiles,
                     nullptr, nullptr,  p.ntile_count,       p.ntile_ready};
  a.band_n = p.band_n;
  a.group = p.raster_group;
  return a;
}

}  // namespace comet::gpu
