// The per-call protocol on the GPU: the device-side equivalent of what the CPU backend does around
// its fused "kernel" (csrc/cpu/), with the planning done by the engine's multi-block prologue
// programs (comet/prologue.h), the same source the CPU backend runs on thread teams. No host
// synchronisation is needed anywhere in it: sizes only the device knows (rows M, m-tiles,
// reduce-plan entries) go to DeviceState, which the fused kernels read.
//
//   source kernel  (grid of source_blocks x 256): validates the expert ids (first bad slot into
//                  DeviceState) and builds this rank's send plan (layer0) or its (token,
//                  destination) pair lists (layer1) in local scratch;
//   begin kernel   (one block): call counter, buffer-reuse wait, metadata exchange and verdict,
//                  layer0's dispatch layout (O(E*W), one thread) and M;
//   publish kernel (grid of plan_blocks x 256): announces this rank's source data, then m-tiles
//                  and layer0's order, or layer1's reduce plan from the peers' pair lists.
// The grids synchronise inside one launch with the engine's grid barrier (parallel.h; state in
// DeviceState), so the host sizes them to at most one block per SM (all resident).
//
// Peers on other nodes (p.topo; null in p.headers / p.datas) are never read: what they announce
// arrives in this rank's header mailboxes (header_flag(own, W, PeerFlag::.., s), header_meta_box),
// written by their put_signal, and what this rank announces to them it sends the same way
// (through the put ring and the proxy kernel, proxy.h). Same-node peers keep the direct protocol
// (their own header words, read by pointer). Across nodes: "done with the previous call" (sent by
// the proxy's end kernel at the end of each call) and the call metadata (sent by begin).
#include <cstdio>

#include "call_params.h"
#include "comet/flags.h"
#include "comet/layout.h"
#include "comet/node_push.h"
#include "comet/prologue.h"
#include "comet/topology.h"
#include "gpu_context.cuh"
#include "launch.h"

namespace comet::gpu {
namespace {

constexpr int kThreads = kPrologueThreads;

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

// Execution context of the multi-block prologue kernels (exec_context.h): every thread of the
// grid takes part; block_shared() is the block's scan buffer (2 x kThreads values, parallel.h).
class GridContext {
 public:
  __device__ explicit GridContext(const CallParams& p)
      : p_(&p), wc_{p.error, p.timeout_ns, p.rank} {}
  __device__ int32_t block() const { return int32_t(blockIdx.x); }
  __device__ int32_t blocks() const { return int32_t(gridDim.x); }
  __device__ int32_t thread() const { return int32_t(threadIdx.x); }
  __device__ int32_t threads() const { return int32_t(blockDim.x); }
  __device__ void sync() { __syncthreads(); }
  __device__ void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    if (threadIdx.x == 0) spin_until(wc_, flag, epoch, site, index);
    __syncthreads();
  }
  __device__ void fence_peers() { __threadfence(); }  // the grid barrier's flags are local
  __device__ void work(int64_t) {}
  __device__ void* block_shared() {
    __shared__ int64_t scan[2 * kThreads];
    return scan;
  }
  // Symmetric memory and the inter-node transport, for the engine's source-side programs (the
  // node-first pushes run in the publish kernel): same-node ranks by pointer (null otherwise).
  __device__ char* data(int32_t r) const { return p_->datas[r]; }
  __device__ RankHeader* header(int32_t r) const { return p_->headers[r]; }
  __device__ bool reachable(int32_t r) const { return p_->topo.same_node(p_->rank, r); }
  __device__ void put_signal(int32_t r, void* dst, const void* src, size_t bytes, uint64_t* sig,
                             uint64_t value) {
    gpu::put_signal(*p_, r, dst, src, bytes, sig, value);
  }

 private:
  const CallParams* p_;  // the kernel's __grid_constant__ parameters
  WaitConfig wc_;
};

// Where this rank reads the flag `kind` that rank s announces to it: s's own header word `own`
// (by pointer) when s is on this node, else this rank's mailbox for s, written by s's put_signal.
__device__ uint64_t* announced(const CallParams& p, int32_t s, uint64_t (RankHeader::*own)[kFlagStride],
                               PeerFlag kind) {
  if (p.topo.same_node(p.rank, s)) return p.headers[s]->*own;
  return header_flag(p.headers[p.rank], p.world, kind, s);
}

// Rank s's bucket offsets in this rank's bucket box (layer0 across nodes; symm_layout.h).
__device__ char* bucket_box_of(const CallParams& p, int32_t s) {
  return p.datas[p.rank] + p.regions.bucket_box + size_t(s) * size_t(p.num_experts + 1) * 4;
}

// The flag saying source s's published data of this call is readable here: its own data flag on
// this node, the MirrorMeta flag its push set on this node's relay across nodes.
__device__ uint64_t* source_ready(const CallParams& p, int32_t s) {
  if (p.topo.same_node(p.rank, s)) return p.headers[s]->data_epoch;
  return header_flag(p.headers[p.topo.relay(s, p.topo.node(p.rank))], p.world,
                     PeerFlag::MirrorMeta, s);
}

__device__ PrologueScratch prologue_scratch(const CallParams& p) {
  return PrologueScratch{GridBarrier{&p.state->grid_arrived, &p.state->grid_generation},
                         SortScratch{p.sort_counts, ScanScratch{p.block_sum, p.scan_total}},
                         p.item_keys, p.small};
}

__global__ void __launch_bounds__(kThreads) source_kernel(const __grid_constant__ CallParams p) {
  GridContext ctx(p);
  const PrologueScratch s = prologue_scratch(p);
  // Routing values (shapes and dtypes were checked on the host): the first bad slot, if any.
  if (grid_rank(ctx) == 0) p.state->first_bad_id = ~0ull;
  grid_sync(ctx, s.bar);
  const Share sh = share_of(p.tokens * p.topk, grid_rank(ctx), grid_size(ctx));
  for (int64_t i = sh.begin; i < sh.end; ++i) {
    const int32_t v = p.ids[i];
    if (v < -1 || v >= p.num_experts) {
      atomicMin(&p.state->first_bad_id, (unsigned long long)i);
      break;
    }
  }
  if (p.op == int32_t(OpKind::Layer0))
    send_plan_program(ctx, s, p.ids, p.tokens, p.topk, p.num_experts, p.bucket, p.send_slot,
                      p.send_pos);
  else
    pair_list_program(ctx, s, p.ids, p.tokens, p.topk, p.num_experts, p.world, p.pair_off,
                      p.pair_slot);
}

__global__ void __launch_bounds__(kThreads) begin_kernel(const __grid_constant__ CallParams p,
                                                         const __grid_constant__ CallMeta meta) {
  if (threadIdx.x != 0) return;
  const WaitConfig wc{p.error, p.timeout_ns, p.rank};
  const bool layer0 = p.op == int32_t(OpKind::Layer0);
  DeviceState* st = p.state;
  const uint64_t e = st->epoch + 1;
  st->epoch = e;
  st->kernel_start = ~0ull;
  st->kernel_end = 0;
  CallMeta me = meta;
  me.epoch = e;
  // Buffer reuse: every peer finished reading (and writing) our memory in the previous call.
  for (int32_t s = 0; s < p.world; ++s)
    spin_until(wc, announced(p, s, &RankHeader::done_epoch, PeerFlag::Done), e - 1,
               WaitSite::PeerDone, s);

  const char* op_name = layer0 ? "comet.moe_layer0: " : "comet.moe_layer1: ";
  const unsigned long long bad_slot = p.ids != nullptr ? st->first_bad_id : ~0ull;
  if (me.error == 0 && bad_slot != ~0ull) {
    const int64_t i = int64_t(bad_slot);
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
      // With max_rows, h has max_rows rows (checked on the host) and holds the first M of them.
      Message m(me.message, int(sizeof(me.message)));
      m << op_name << "h has " << p.h_rows << " rows but the layout dispatches " << rows;
      if (p.max_rows >= 0) m << " (more than max_rows = " << p.max_rows << ")";
      m << ": pass the layout moe_layer0 returned with this h";
      me.error = 1;
    }
  }
  if (me.error == 0 && layer0) {
    // The send plan's bucket offsets are published at once (offset 0 of the data segment, which
    // does not depend on the segment's token capacity) so every destination can size its
    // dispatch layout during this exchange.
    int32_t* pub = reinterpret_cast<int32_t*>(p.datas[p.rank] + p.regions.bucket_off);
    for (int32_t i = 0; i <= p.num_experts; ++i) pub[i] = p.bucket[i];
    // Ranks of other nodes get them in their bucket box for us (capacity-independent too),
    // before our metadata: the metadata's signal follows them on the link (FIFO per target).
    for (int32_t r = 0; r < p.world; ++r)
      if (!p.topo.same_node(p.rank, r))
        put_signal(p, r, bucket_box_of(p, p.rank), pub, size_t(p.num_experts + 1) * 4, nullptr, 0);
  }

  // Metadata exchange: same-node peers read our header's meta; every peer on another node gets a
  // copy in its mailbox for us (from our header: a put's source must be symmetric memory, and
  // this one stays unchanged until the call ends, when the proxy's quiet has delivered it).
  RankHeader* mine = p.headers[p.rank];
  mine->meta = me;
  flag_release(mine->meta_epoch, e);
  for (int32_t r = 0; r < p.world; ++r)
    if (!p.topo.same_node(p.rank, r))
      put_signal(p, r, header_meta_box(mine, p.world, p.rank), &mine->meta, sizeof(CallMeta),
                 header_flag(mine, p.world, PeerFlag::Meta, p.rank), e);
  int64_t max_tokens = 0;
  for (int32_t s = 0; s < p.world; ++s) {
    const bool near = p.topo.same_node(p.rank, s);
    spin_until(wc, announced(p, s, &RankHeader::meta_epoch, PeerFlag::Meta), e,
               WaitSite::PeerMeta, s);
    const CallMeta* m = near ? &p.headers[s]->meta : header_meta_box(mine, p.world, s);
    p.metas[s] = *m;
    max_tokens = p.metas[s].tokens > max_tokens ? p.metas[s].tokens : max_tokens;
  }
  const int32_t bad = verdict(p.metas, p.world);
  st->bad_rank = bad;
  st->max_tokens = max_tokens;
  st->rows = 0;
  st->num_mtiles = 0;
  st->plan_entries = 0;
  st->plan_slots = 0;
  int32_t status = bad == -2 ? int32_t(CallStatus::Ok) : int32_t(CallStatus::Rejected);

  if (status == int32_t(CallStatus::Ok) && layer0) {
    const int32_t El = p.experts_local, d = p.rank;
    // Each source's bucket offsets: by pointer on this node, from our bucket box across nodes
    // (p.sources as scratch here: bases whose bucket_off region is the offsets to read; the
    // publish kernel sets the real source bases).
    for (int32_t s = 0; s < p.world; ++s)
      p.sources[s] = p.topo.same_node(d, s)
                         ? p.datas[s]
                         : bucket_box_of(p, s) - p.regions.bucket_off;
    gather_recv_counts(p.sources, p.regions.bucket_off, d, p.world, El, p.recv_counts);
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
  GridContext ctx(p);
  const PrologueScratch s = prologue_scratch(p);
  // Our source data (x and the send plan / the routing and pair lists) is in our data segment:
  // peers may read.
  if (grid_rank(ctx) == 0) flag_release(p.headers[p.rank]->data_epoch, e);
  const int32_t El = p.experts_local, W = p.world, d = p.rank;
  const bool layer1 = p.op == int32_t(OpKind::Layer1);
  if (p.topo.nodes() > 1) {
    // Node-first pushes to the other nodes' mirrors (node_push.h), whatever this rank's own
    // status (a local row overflow must not starve the peers), then where each source is read.
    const NodePushArgs na{p.topo, d, p.num_experts, El, p.topk, p.tokens,
                          p.hidden * p.elem_bytes, 4, e, p.regions, p.ids};
    if (layer1)
      layer1_push_program(ctx, na);
    else
      layer0_push_program(ctx, s.bar, na);
    if (grid_rank(ctx) == 0)
      for (int32_t src = 0; src < W; ++src) {
        p.sources[src] = source_base(p.topo, p.datas, d, src, p.regions.mirror,
                                     p.regions.source_bytes);
        p.rows_ready[src] =
            p.topo.same_node(d, src)
                ? nullptr
                : header_flag(p.headers[p.topo.relay(src, p.topo.node(d))], W,
                              PeerFlag::MirrorRows, src);
      }
  }
  if (status != int32_t(CallStatus::Ok)) return;

  if (layer1) {
    for (int32_t src = 0; src < W; ++src) ctx.wait(source_ready(p, src), e, WaitSite::PeerData, src);
    if (grid_rank(ctx) == 0) {
      build_dispatch_layout(p.recv_counts, d, W, El, p.expert_off, p.seg_off);
      for (int32_t src = 0; src < W; ++src)
        p.plan_sources[src] = plan_source<float>(
            p.topo.nodes() > 1 ? p.sources[src] : p.datas[src], p.regions);
    }
    grid_sync(ctx, s.bar);
  }
  const TilePlanArgs ta{p.expert_off, p.seg_off, W, El, p.tile_m, p.mtiles_cap, p.mtiles,
                        layer1 ? nullptr : p.mtile_order, p.order_bucket};
  const int64_t mtiles = tile_plan_program(ctx, s, ta);
  if (mtiles < 0) {
    if (grid_rank(ctx) == 0) record_overflow(p, 3, mtiles, p.mtiles_cap);
    __trap();
  }
  int64_t entries = 0;
  if (layer1) {
    const ReducePlanArgs<float> ra{p.plan_sources, d, W, p.topk, El, p.seg_off, p.plan_cap,
                                   p.plan, &st->plan_slots,
                                   p.topo.reduce_rpn()};
    entries = reduce_plan_program(ctx, s, ra);
    if (entries < 0) {
      // The peers' routing does not match this rank's layout (recv_counts): refuse rather than
      // overrun the plan.
      if (grid_rank(ctx) == 0) record_overflow(p, 3, entries, p.plan_cap);
      __trap();
    }
  }
  if (grid_rank(ctx) == 0) {
    st->num_mtiles = mtiles;
    st->plan_entries = entries;
  }
}

__global__ void finish_kernel(const __grid_constant__ CallParams p) {
  if (threadIdx.x == 0) flag_release(p.headers[p.rank]->done_epoch, p.state->epoch);
}

}  // namespace

void launch_source(const CallParams& p, cudaStream_t stream) {
  if (p.ids == nullptr) return;  // rejected on the host: nothing to plan
  source_kernel<<<p.source_blocks, kThreads, 0, stream>>>(p);
}

void launch_begin(const CallParams& p, const CallMeta& me, cudaStream_t stream) {
  begin_kernel<<<1, 32, 0, stream>>>(p, me);
}

void launch_publish(const CallParams& p, cudaStream_t stream) {
  publish_kernel<<<p.plan_blocks, kThreads, 0, stream>>>(p);
}

void launch_finish(const CallParams& p, cudaStream_t stream) {
  finish_kernel<<<1, 32, 0, stream>>>(p);
}

cudaError_t preload_prologue_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(&source_kernel),
                           reinterpret_cast<const void*>(&begin_kernel),
                           reinterpret_cast<const void*>(&publish_kernel),
                           reinterpret_cast<const void*>(&finish_kernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes a;
    const cudaError_t e = cudaFuncGetAttributes(&a, k);  // loads it (lazy loading)
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace comet::gpu
