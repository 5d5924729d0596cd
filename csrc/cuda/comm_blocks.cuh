// The comm side of both fused kernels (any architecture): the comm blocks (comet/block_roles.h:
// layer0's first n_comm blocks, layer1's last n_comm) run the engine's comm programs
// (csrc/include/comet/comm_layer0.h / comm_layer1.h) with a CommContext; layer0's then arrive on
// the call's "done" counter: the last comm block tells every peer that this rank finished touching
// their memory for this call (the buffer-reuse handshake the next call's prologue waits for).
#pragma once

#include "call_params.h"
#include "comet/block_roles.h"
#include "comet/comm_layer0.h"
#include "comet/comm_layer1.h"
#include "comet/flags.h"
#include "gpu_context.cuh"

namespace comet::gpu {

static __device__ __forceinline__ WaitConfig wait_config(const CallParams& p) {
  return WaitConfig{p.error, p.timeout_ns, p.rank};
}

static __device__ __forceinline__ void finish_comm_block(const CallParams& p, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0)
    arrive_and_publish(&p.state->comm_done, uint32_t(p.n_comm), p.headers[p.rank]->done_epoch,
                       epoch);
}

// Comm block `block` of p.n_comm.
static __device__ void layer0_comm_block(const CallParams& p, int32_t block, uint64_t epoch,
                                         char* smem) {
  const DeviceState* st = p.state;
  if (st->status == int32_t(CallStatus::Ok)) {
    const int64_t num_mtiles = st->num_mtiles;
    if (p.mode == int32_t(BenchMode::GemmOnly)) {
      // GEMM-only timing: publish every m-tile at once, no rows move (the GEMM reads stale A).
      for (int64_t i = block; i < num_mtiles; i += p.n_comm)
        if (threadIdx.x == 0) flag_release(&p.mtile_ready[p.mtile_order[i]], epoch);
    } else {
      CommContext ctx(p, block, p.n_comm, epoch, /*wait_source_data=*/true, smem);
      const bool nodes = p.topo.nodes() > 1;
      Layer0CommArgs a{p.rank,           p.world,         p.experts_local, p.topk,
                             p.row_bytes,                      epoch,           p.regions,
                             p.seg_off,        p.mtiles,        p.mtile_order,   num_mtiles,
                             p.a,              p.mtile_ready,   p.row_source,    p.row_token,
                             p.row_slot,       nodes ? p.sources : nullptr,
                             nodes ? p.rows_ready : nullptr};
      a.tp = p.tp;
      a.mtile_rows = p.mtile_rows;
      a.dedup = p.dedup != 0;
      a.rows_received = reinterpret_cast<uint64_t*>(&p.state->layer0_rows_received);
      layer0_comm(ctx, a);
    }
  }
  finish_comm_block(p, epoch);
}

// layer1's comm program arguments (the fused kernel's comm blocks and the combine kernel).
static __device__ __forceinline__ Layer1CommArgs<float> layer1_comm_args(const CallParams& p,
                                                                         uint64_t epoch) {
  ReducePlan<float> plan = p.plan;
  plan.entries = p.state->plan_entries;
  // The reduce-and-send's chunks: 4 per comm block of the launch that runs it (the combine
  // kernel, which reads only the other fields, has the fused grid's size).
  const int64_t per_item =
      ceil_div(plan.entries, int64_t(4) * comm_program_blocks(int32_t(gridDim.x), p.n_comm));
  Layer1CommArgs<float> a{p.rank,       p.world,         p.experts_local,
                               p.topk,       int32_t(p.hidden), p.tile_n,
                               p.num_ntiles, p.tcap,          epoch,
                               p.regions,    p.c,             p.ntile_ready,
                               plan,         per_item > 0 ? per_item : 1,
                               &p.state->blocks_done,         p.tokens,
                               p.ids,        p.out,           ScalarKind(p.out_kind),
                               // across nodes: staged partial rows for homes on other nodes
                               p.topo.nodes() > 1 ? p.topo.ranks_per_node : 0,
                               p.topo.nodes() > 1 ? p.datas[p.rank] + p.regions.stage : nullptr,
                               p.chunk_done,
                               // node-reduced: rows into the relays' node_stage, summed there
                               p.topo.node_reduce,  p.metas};
  a.tp = p.tp;
  a.rows_sent = reinterpret_cast<uint64_t*>(&p.state->layer1_rows_sent);
  return a;
}

// layer1's comm blocks only reduce and send; the combine and the "done" handshake follow in the
// combine kernel (combine.cu), on every SM.
static __device__ void layer1_comm_block(const CallParams& p, int32_t block, uint64_t epoch,
                                         char* smem) {
  const DeviceState* st = p.state;
  if (st->status == int32_t(CallStatus::Ok) && p.mode != int32_t(BenchMode::GemmOnly)) {
    CommContext ctx(p, block, p.n_comm, epoch, /*wait_source_data=*/false, smem);
    layer1_reduce_send(ctx, layer1_comm_args(p, epoch));
  }
}

// This block's index among the comm blocks / the GEMM blocks of a fused kernel of layer kLayer
// (comet/block_roles.h: no block waits on a higher-index one, so the kernel finishes however few
// of its blocks are resident). Plain offsets from blockIdx.x, cheap to rematerialise.
template <int kLayer>
static __device__ __forceinline__ int32_t comm_block_index(const CallParams& p) {
  return int32_t(blockIdx.x) - first_comm_block(kLayer, int32_t(gridDim.x), p.n_comm);
}
template <int kLayer>
static __device__ __forceinline__ int32_t gemm_block_index(const CallParams& p) {
  return int32_t(blockIdx.x) - first_gemm_block(kLayer, p.n_comm);
}

// The thread-block specialisation both fused kernels (sm80, sm90) start with: a comm block runs
// the layer's comm program and reports true; the caller's GEMM blocks go on (GEMM block
// gemm_block_index of gridDim.x - n_comm).
// smem: the kernel's dynamic shared memory (at least kBlockSharedBytes; the comm programs' scratch).
template <int kLayer>
static __device__ __forceinline__ bool ran_comm_block(const CallParams& p, uint64_t epoch,
                                                      char* smem) {
  const int32_t c = comm_block_index<kLayer>(p);
  if (uint32_t(c) >= uint32_t(p.n_comm)) return false;
  if constexpr (kLayer == 0)
    layer0_comm_block(p, c, epoch, smem);
  else
    layer1_comm_block(p, c, epoch, smem);
  return true;
}

// The GEMM side of an mma.sync fused kernel (sm80, sm89) once ran_comm_block said no: this block's
// index among the GEMM blocks and their count, whether it computes tiles (not in comm-only
// timing, where layer1's columns are still published), and whether it has anything to do at all
// (not in a rejected call, nor in layer0's comm-only timing, whose comm needs no GEMM block).
struct MmaGemmBlock {
  int32_t g, ng;
  bool compute, active;
};
template <int kLayer>
static __device__ __forceinline__ MmaGemmBlock mma_gemm_block(const CallParams& p) {
  const bool compute = p.mode != int32_t(BenchMode::CommOnly);
  const bool active = p.state->status == int32_t(CallStatus::Ok) && (kLayer == 1 || compute);
  return MmaGemmBlock{gemm_block_index<kLayer>(p), int32_t(gridDim.x) - p.n_comm, compute, active};
}

}  // namespace comet::gpu
