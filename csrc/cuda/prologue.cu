// The per-call protocol on the GPU: the device-side equivalent of what the CPU backend does on the
// host before its fused "kernel" (csrc/cpu/ops_cpu.cpp), built from the same portable functions
// (comet/layout.h, tile_order.h, reduce_plan.h) so the layouts and orders are the engine's own.
// No host synchronisation is needed anywhere in it: sizes only the device knows (rows M, m-tiles,
// reduce-plan entries) go to DeviceState, which the fused kernels read.
//
// First version, one block per kernel: the engine's functions are sequential, so they run on one
// thread each (the send plan over shared-memory buckets; the dispatch layout; m-tiles and their
// order), the reduce plan on one thread per source (each builds its source's slice of the plan
// from a local copy of that source's routing, which the whole block staged first, so no thread
// waits on NVLink latency in a loop). Routing validation and the staging copies use the block.
// That is correct for every shape; the serial parts are O(T*k) per rank on the critical path.
#include <cstdio>

#include "call_params.h"
#include "comet/flags.h"
#include "comet/layout.h"
#include "comet/reduce_plan.h"
#include "comet/tile_order.h"
#include "gpu_context.cuh"
#include "launch.h"
#include "plan_parts.h"

namespace comet::gpu {
namespace {

constexpr int kThreads = 256;

// Error text built on the device, in the CPU backend's wording.
struct Message {
  char* buf;
  int cap;
  int len;
  __device__ Message(char* b, int c) : buf(b), cap(c), len(0) { buf[0] = 0; }
  __device__ Message& operator<<(const char* s) {
    while (*s && len < cap - 1) buf[len++] = *s++;
    buf[len] = 0;
    return *this;
  }
  __device__ Message& operator<<(int64_t v) {
    char tmp[24];
    int n = 0;
    uint64_t u = v < 0 ? uint64_t(0) - uint64_t(v) : uint64_t(v);
    do {
      tmp[n++] = char('0' + u % 10);
      u /= 10;
    } while (u != 0);
    if (v < 0) tmp[n++] = '-';
    while (n > 0 && len < cap - 1) buf[len++] = tmp[--n];
    buf[len] = 0;
    return *this;
  }
};

// Same rules as the CPU heap's verdict: -2 when every rank's call is fine and they agree, the
// first rank that rejected its input, or -1 when ranks disagree on the call.
__device__ int32_t verdict(const CallMeta* m, int32_t world) {
  for (int32_t s = 0; s < world; ++s)
    if (m[s].error != 0) return s;
  for (int32_t s = 1; s < world; ++s)
    if (m[s].op != m[0].op || m[s].world != m[0].world || m[s].group_hash != m[0].group_hash ||
        m[s].num_experts != m[0].num_experts || m[s].topk != m[0].topk ||
        m[s].hidden != m[0].hidden || m[s].cols != m[0].cols || m[s].dtype != m[0].dtype)
      return -1;
  return -2;
}

__device__ void record_overflow(const CallParams& p, int32_t code, int64_t value, int64_t limit) {
  ErrorRecord* e = p.error;
  if (e != nullptr && atomicCAS(reinterpret_cast<int*>(&e->code), 0, code) == 0) {
    e->rank = p.rank;
    e->block = int32_t(blockIdx.x);
    e->index = value;
    e->limit = limit;
    e->epoch = p.state->epoch;
    __threadfence_system();
  }
}

__global__ void __launch_bounds__(kThreads) begin_kernel(const __grid_constant__ CallParams p,
                                                         const __grid_constant__ CallMeta meta,
                                                         bool smem_buckets) {
  extern __shared__ int32_t s_buckets[];  // [2E+1] when smem_buckets: bucket offsets, fill
  __shared__ CallMeta me;
  __shared__ uint64_t s_epoch;
  __shared__ unsigned long long s_bad;
  const WaitConfig wc{p.error, p.timeout_ns, p.rank};
  const int tid = int(threadIdx.x);
  const bool layer0 = p.op == int32_t(OpKind::Layer0);

  if (tid == 0) {
    const uint64_t e = p.state->epoch + 1;
    p.state->epoch = e;
    p.state->kernel_start = ~0ull;
    p.state->kernel_end = 0;
    s_epoch = e;
    me = meta;
    me.epoch = e;
    s_bad = ~0ull;
    // Buffer reuse: every peer finished reading (and writing) our memory in the previous call.
    for (int32_t s = 0; s < p.world; ++s)
      spin_until(wc, p.headers[s]->done_epoch, e - 1, WaitSite::PeerDone, s);
  }
  __syncthreads();
  const uint64_t e = s_epoch;

  // Routing values (shapes and dtypes were checked on the host).
  if (meta.error == 0 && p.ids != nullptr) {
    const int64_t n = p.tokens * p.topk;
    for (int64_t i = tid; i < n; i += kThreads) {
      const int32_t v = p.ids[i];
      if (v < -1 || v >= p.num_experts) atomicMin(&s_bad, (unsigned long long)i);
    }
  }
  __syncthreads();
  if (tid != 0) return;

  const char* op_name = layer0 ? "comet.moe_layer0: " : "comet.moe_layer1: ";
  if (me.error == 0 && s_bad != ~0ull) {
    const int64_t i = int64_t(s_bad);
    Message(me.message, int(sizeof(me.message)))
        << op_name << "topk_ids[" << i / p.topk << ", " << i % p.topk << "] = " << int64_t(p.ids[i])
        << " is not an expert id: valid ids are 0.." << int64_t(p.num_experts - 1)
        << " and -1 (dropped slot)";
    me.error = 1;
  }
  if (me.error == 0 && !layer0) {
    int64_t rows = 0;
    bool negative = false;
    for (int32_t i = 0; i < p.world * p.experts_local; ++i) {
      rows += p.recv_counts[i];
      negative |= p.recv_counts[i] < 0;
    }
    if (negative || (p.max_rows < 0 ? rows != p.h_rows : rows > p.h_rows)) {
      Message(me.message, int(sizeof(me.message)))
          << op_name << "h has " << p.h_rows << " rows but the layout dispatches " << rows
          << ": pass the layout moe_layer0 returned with this h";
      me.error = 1;
    }
  }
  if (me.error == 0 && layer0) {
    // Send plan; its bucket offsets are published at once (offset 0 of the data segment, which
    // does not depend on the segment's token capacity) so every destination can size its
    // dispatch layout during this exchange.
    // The counting sort's counters in shared memory when they fit (one thread walks T*k slots).
    int32_t* bucket = smem_buckets ? s_buckets : p.bucket;
    int32_t* fill = smem_buckets ? s_buckets + p.num_experts + 1 : p.fill;
    build_send_plan(p.ids, p.tokens, p.topk, p.num_experts, bucket, p.send_slot, p.send_pos, fill);
    int32_t* pub = reinterpret_cast<int32_t*>(p.datas[p.rank] + p.regions.bucket_off);
    for (int32_t i = 0; i <= p.num_experts; ++i) {
      pub[i] = bucket[i];
      p.bucket[i] = bucket[i];
    }
  }

  // Metadata exchange.
  RankHeader* mine = p.headers[p.rank];
  mine->meta = me;
  flag_release(mine->meta_epoch, e);
  int64_t max_tokens = 0;
  for (int32_t s = 0; s < p.world; ++s) {
    spin_until(wc, p.headers[s]->meta_epoch, e, WaitSite::PeerMeta, s);
    p.metas[s] = p.headers[s]->meta;
    max_tokens = p.metas[s].tokens > max_tokens ? p.metas[s].tokens : max_tokens;
  }
  const int32_t bad = verdict(p.metas, p.world);
  DeviceState* st = p.state;
  st->bad_rank = bad;
  st->max_tokens = max_tokens;
  st->rows = 0;
  st->num_mtiles = 0;
  st->plan_entries = 0;
  st->plan_slots = 0;
  int32_t status = bad == -2 ? int32_t(CallStatus::Ok) : int32_t(CallStatus::Rejected);

  if (status == int32_t(CallStatus::Ok) && layer0) {
    const int32_t El = p.experts_local, d = p.rank;
    for (int32_t s = 0; s < p.world; ++s) {
      const int32_t* bo = reinterpret_cast<const int32_t*>(p.datas[s] + p.regions.bucket_off);
      for (int32_t el = 0; el < El; ++el)
        p.recv_counts[s * El + el] = bo[d * El + el + 1] - bo[d * El + el];
    }
    const int64_t rows = build_dispatch_layout(p.recv_counts, d, p.world, El, p.expert_off,
                                               p.seg_off);
    st->rows = rows;
    if (p.max_rows >= 0 && rows > p.max_rows) {
      // Local: this rank skips its GEMM and rows (peers are unaffected) and the next call, or
      // Buffer.check(), reports it.
      status = int32_t(CallStatus::RowsOverflow);
      record_overflow(p, 2, rows, p.max_rows);
    }
  }
  if (status == int32_t(CallStatus::Rejected) && p.max_rows >= 0) {
    // No host reads this call's verdict: keep it for the next call / Buffer.check().
    ErrorRecord* er = p.error;
    if (er != nullptr && atomicCAS(reinterpret_cast<int*>(&er->code), 0, 4) == 0) {
      er->rank = p.rank;
      er->index = bad;
      er->epoch = e;
      Message m(er->message, int(sizeof(er->message)));
      if (bad >= 0) m << p.metas[bad].message;
      __threadfence_system();
    }
  }
  st->status = status;
}

__global__ void __launch_bounds__(kThreads) publish_kernel(const __grid_constant__ CallParams p) {
  DeviceState* st = p.state;
  const uint64_t e = st->epoch;
  const int32_t status = st->status;
  if (status == int32_t(CallStatus::Rejected)) return;
  const int tid = int(threadIdx.x);
  // Our source data (x and the send plan / the routing) is in our data segment: peers may read.
  if (tid == 0) flag_release(p.headers[p.rank]->data_epoch, e);
  if (status != int32_t(CallStatus::Ok)) return;

  const int32_t El = p.experts_local, W = p.world, d = p.rank, k = p.topk;
  const WaitConfig wc{p.error, p.timeout_ns, p.rank};
  if (p.op == int32_t(OpKind::Layer1)) {
    if (tid == 0) {
      build_dispatch_layout(p.recv_counts, d, W, El, p.expert_off, p.seg_off);
      for (int32_t s = 0; s < W; ++s)
        spin_until(wc, p.headers[s]->data_epoch, e, WaitSite::PeerData, s);
    }
    __syncthreads();
    // Stage every source's routing in local memory (whole block), then one thread per source
    // builds that source's part of the plan with the engine's functions: a view in which only
    // source s has tokens yields exactly s's entries (source-major order, as the full plan).
    const int64_t stride = p.stage_tokens * k;
    SourceRouting<float>* all = p.sources + int64_t(W) * W;  // the staged sources
    for (int32_t s = 0; s < W; ++s) {
      const char* sd = p.datas[s];
      const size_t bytes = size_t(p.metas[s].tokens * k) * 4;
      cooperative_copy(p.stage_ids + s * stride, sd + p.regions.ids, bytes, tid, kThreads);
      cooperative_copy(p.stage_pos + s * stride, sd + p.regions.send_pos, bytes, tid, kThreads);
      cooperative_copy(p.stage_weights + s * stride, sd + p.regions.weights, bytes, tid, kThreads);
      if (tid == 0)
        all[s] = SourceRouting<float>{p.stage_ids + s * stride, p.stage_pos + s * stride,
                                      p.stage_weights + s * stride, p.metas[s].tokens};
    }
    __syncthreads();
    int64_t* counts = p.plan_counts;       // [0, W): entries, [W, 2W): slots of each source
    int64_t* offsets = p.plan_counts + 2 * W;  // [0, W]: entry offsets, [W+1, 2W+1]: slot offsets
    for (int32_t s = tid; s < W; s += kThreads) {
      SourceRouting<float>* view = p.sources + int64_t(s) * W;
      source_view(all, W, s, view);
      int64_t slots = 0;
      counts[s] = reduce_plan_size(view, W, k, El, d, &slots);
      counts[W + s] = slots;
    }
    __syncthreads();
    if (tid == 0) {
      offsets[0] = 0;
      offsets[W + 1] = 0;
      for (int32_t s = 0; s < W; ++s) {
        offsets[s + 1] = offsets[s] + counts[s];
        offsets[W + 2 + s] = offsets[W + 1 + s] + counts[W + s];
      }
      const int64_t entries = offsets[W], slots = offsets[2 * W + 1];
      if (entries > p.plan_cap || slots > p.plan_cap) {
        // The peers' routing does not match this rank's layout (recv_counts): refuse rather
        // than overrun the plan.
        record_overflow(p, 3, entries > slots ? entries : slots, p.plan_cap);
        __trap();
      }
      st->plan_entries = entries;
      st->plan_slots = slots;
    }
    __syncthreads();
    for (int32_t s = tid; s < W; s += kThreads) {
      ReducePlan<float> part = plan_part(p.plan, offsets[s], offsets[W + 1 + s]);
      build_reduce_plan(p.sources + int64_t(s) * W, W, k, El, d, p.seg_off, part);
    }
    __syncthreads();
    ReducePlan<float> plan = p.plan;
    for (int32_t s = 0; s < W; ++s)
      for (int64_t i = offsets[s] + tid; i < offsets[s + 1]; i += kThreads)
        fix_entry_begin(plan, i, offsets[s], offsets[W + 1 + s]);
    if (tid == 0) plan.entry_begin[offsets[W]] = offsets[2 * W + 1];
  }
  if (tid != 0) return;
  const int64_t mtiles = count_mtiles(p.expert_off, El, p.tile_m);
  if (mtiles > p.mtiles_cap) {
    record_overflow(p, 3, mtiles, p.mtiles_cap);
    __trap();
  }
  build_mtiles(p.expert_off, El, p.tile_m, p.mtiles);
  if (p.op == int32_t(OpKind::Layer0))
    layer0_mtile_order(p.mtiles, mtiles, p.seg_off, W, p.mtile_order, p.order_scratch);
  st->num_mtiles = mtiles;
}

__global__ void finish_kernel(const __grid_constant__ CallParams p) {
  if (threadIdx.x == 0) flag_release(p.headers[p.rank]->done_epoch, p.state->epoch);
}

}  // namespace

void launch_begin(const CallParams& p, const CallMeta& me, cudaStream_t stream) {
  const size_t smem = (size_t(2) * p.num_experts + 1) * sizeof(int32_t);
  const bool in_smem = p.op == int32_t(OpKind::Layer0) && smem <= 48 * 1024;
  begin_kernel<<<1, kThreads, in_smem ? smem : 0, stream>>>(p, me, in_smem);
}

void launch_publish(const CallParams& p, cudaStream_t stream) {
  publish_kernel<<<1, kThreads, 0, stream>>>(p);
}

void launch_finish(const CallParams& p, cudaStream_t stream) {
  finish_kernel<<<1, 32, 0, stream>>>(p);
}

}  // namespace comet::gpu
