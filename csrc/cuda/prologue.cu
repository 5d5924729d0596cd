// The per-call protocol on the GPU: the device-side equivalent of what the CPU backend does around
// its fused "kernel" (csrc/cpu/), with the planning done by the engine's multi-block prologue
// programs (comet/prologue.h), the same source the CPU backend runs on thread teams. No host
// synchronisation is needed anywhere in it: sizes only the device knows (rows M, m-tiles,
// reduce-plan entries) go to DeviceState, which the fused kernels read.
//
//   source kernel  (grid of source_blocks x 256): validates the expert ids (first bad slot into
//                  DeviceState) and builds this rank's send plan (layer0) or its (token,
//                  destination) pair lists (layer1) in local scratch;
//   begin kernel   (grid of begin_blocks x 256, usually one block): call counter, buffer-reuse
//                  wait, metadata exchange and verdict (a peer per thread), the dispatch layout
//                  and M (dispatch_layout_program: layer0's from the peers' bucket offsets,
//                  layer1's from the caller's recv_counts, checked against h);
//   publish kernel (grid of plan_blocks x 256): announces this rank's source data, then m-tiles
//                  and layer0's order, or layer1's reduce plan from the peers' pair lists.
//   finish kernel  (one thread): "done with the peers' memory" on this node (the proxy's end kernel
//                  sends it across nodes).
// The grids synchronise inside one launch with the engine's grid barrier (parallel.h; state in
// DeviceState), so every such kernel is launched cooperatively (launch_grid_program): the runtime
// guarantees all its blocks are resident at once, and the grid is clamped to the occupancy.
//
// Peers on other nodes (p.topo; null in p.headers / p.datas) are never read: what they announce
// arrives in this rank's header mailboxes (header_flag(own, W, PeerFlag::.., s), header_meta_box),
// written by their put_signal, and what this rank announces to them it sends the same way
// (through the put ring and the proxy kernel, proxy.h). Same-node peers keep the direct protocol
// (their own header words, read by pointer). Across nodes: "done with the previous call" (sent by
// the proxy's end kernel at the end of each call) and the call metadata (sent by begin).
#include <cstdio>

#include "call_params.h"
#include "comet/capture_rule.h"
#include "comet/flags.h"
#include "comet/layout.h"
#include "comet/node_push.h"
#include "comet/prologue.h"
#include "comet/topology.h"
#include "error_record.cuh"
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
        m[s].tp != m[0].tp || m[s].placement != m[0].placement || m[s].num_experts != m[0].num_experts || m[s].topk != m[0].topk ||
        m[s].hidden != m[0].hidden || m[s].cols != m[0].cols || m[s].dtype != m[0].dtype ||
        m[s].max_rows != m[0].max_rows)
      return -1;
  return routing_matches_layouts(m, world) ? -2 : -1;
}

// A CallMeta copied a word at a time: a struct copy holds all of it in registers (and spills).
__device__ void copy_meta(CallMeta* dst, const CallMeta* src) {
  static_assert(sizeof(CallMeta) % 8 == 0, "CallMeta is copied in 8-byte words");
  uint64_t* d = reinterpret_cast<uint64_t*>(dst);
  const uint64_t* s = reinterpret_cast<const uint64_t*>(src);
#pragma unroll 1
  for (size_t i = 0; i < sizeof(CallMeta) / 8; ++i) d[i] = s[i];
}

__device__ void record_overflow(const CallParams& p, int32_t code, int64_t value, int64_t limit,
                                int32_t site = 0) {
  ErrorRecord* e = p.error;
  if (claim_error(e, code)) {
    e->site = site;
    e->rank = p.rank;
    e->block = int32_t(blockIdx.x);
    e->index = value;
    e->limit = limit;
    e->epoch = p.state->epoch;
    __threadfence_system();
  }
}

// A plan of the publish kernel outgrew its workspace (`count` > `cap`): recorded as a failure of
// the call (error_record.cuh), which stops it here instead of trapping. The fused kernels and the
// combine skip their work (status), this rank publishes nothing more (its source data, already
// announced, is good), and its peers' waits for what it would have sent end in their timeout.
__device__ void workspace_overflow(const CallParams& p, Workspace what, int64_t count, int64_t cap) {
  record_overflow(p, kErrWorkspace, count, cap, int32_t(what));
  p.state->status = int32_t(CallStatus::Failed);
}

// A CUDA graph captured before the data segment was reallocated (comet/capture_rule.h): true on
// every thread; one records it. The begin kernel checks it before it touches any segment and
// rejects the call, so the kernels after it (publish, fused, combine) skip theirs.
__device__ bool stale_replay(const CallParams& p) {
  const DeviceState* st = p.state;
  if (!stale_launch(p.generation, st->generation)) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0 && claim_error(p.error, kErrStaleGraph)) {
    ErrorRecord* e = p.error;
    e->rank = p.rank;
    e->block = 0;
    e->index = int64_t(p.segment_bytes);
    e->limit = int64_t(st->segment_bytes);
    e->seen = p.generation;
    e->epoch = st->generation;
    __threadfence_system();
  }
  return true;
}

// put_signal (gpu_context.cuh) out of line: the prologue kernels may call functions (unlike the
// fused kernels), and its ring protocol inlined at every put of the node pushes crowds their
// registers into spills.
__device__ __noinline__ void put_out_of_line(const CallParams& p, int32_t r, void* dst,
                                             const void* src, size_t bytes, uint64_t* sig,
                                             uint64_t value) {
  put_signal(p, r, dst, src, bytes, sig, value);
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
    put_out_of_line(*p_, r, dst, src, bytes, sig, value);
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
  // Routing values (shapes and dtypes were checked on the host): the first bad slot, if any,
  // and the rows the routing sends (its slots with an expert id: CallMeta.routed_rows).
  if (grid_rank(ctx) == 0) {
    p.state->first_bad_id = ~0ull;
    p.state->routed_rows = 0;
  }
  grid_sync(ctx, s.bar);
  const Share sh = share_of(p.tokens * p.topk, grid_rank(ctx), grid_size(ctx));
  unsigned long long routed = 0;
  for (int64_t i = sh.begin; i < sh.end; ++i) {
    const int32_t v = p.ids[i];
    if (v < -1 || v >= p.num_experts) {
      atomicMin(&p.state->first_bad_id, (unsigned long long)i);
      break;
    }
    routed += v >= 0;
  }
  if (routed != 0) atomicAdd(&p.state->routed_rows, routed);
  if (p.op == int32_t(OpKind::Layer0))
    send_plan_program(ctx, s, p.ids, p.tokens, p.topk, p.num_experts, p.bucket, p.send_slot,
                      p.send_pos);
  else
    pair_list_program(ctx, s, p.ids, p.tokens, p.topk, p.num_experts, p.world / p.tp, p.pair_off,
                      p.pair_slot);
}

// The begin step as a grid program: every loop over peers or layout cells is split over the
// grid's threads (a thread per peer for the waits, puts and metadata copies; the dispatch layout
// by dispatch_layout_program), so no thread does O(W x E_local) work. One thread keeps the O(1)
// state updates, the error text and the O(W) verdict.
__global__ void __launch_bounds__(kThreads) begin_kernel(const __grid_constant__ CallParams p,
                                                         const __grid_constant__ CallMeta meta) {
  // A stale replay skips the call on every rank alike (all grew together): no call number, no
  // flag; the kernels after this one see the status and skip theirs.
  if (stale_replay(p)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) p.state->status = int32_t(CallStatus::Rejected);
    return;
  }
  GridContext ctx(p);
  const PrologueScratch sc = prologue_scratch(p);
  const WaitConfig wc{p.error, p.timeout_ns, p.rank};
  const bool layer0 = p.op == int32_t(OpKind::Layer0);
  const int32_t W = p.world, El = p.experts_local, d = p.rank;
  const int64_t g = grid_rank(ctx), P = grid_size(ctx);
  DeviceState* st = p.state;
  RankHeader* mine = p.headers[d];
  // Every thread reads the call number before thread 0 advances it (after the barrier below).
  const uint64_t e = st->epoch + 1;
  // Buffer reuse: every peer finished reading (and writing) our memory in the previous call.
  for (int64_t s = g; s < W; s += P)
    spin_until(wc, announced(p, int32_t(s), &RankHeader::done_epoch, PeerFlag::Done), e - 1,
               WaitSite::PeerDone, s);
  // layer1: the dispatch layout of the caller's recv_counts (its row count is part of the
  // verdict); -1: a negative count.
  int64_t rows = 0;
  if (!layer0 && meta.error == 0)
    rows = dispatch_layout_program(
        ctx, sc, DispatchLayoutArgs{nullptr, 0, d, W, El, p.recv_counts, p.expert_off, p.seg_off,
                                    true, p.tp});
  else
    grid_sync(ctx, sc.bar);

  if (g == 0) {
    st->epoch = e;
    st->kernel_start = ~0ull;
    st->kernel_end = 0;
    (layer0 ? st->layer0_rows_received : st->layer1_rows_sent) = 0;
    // Written in place: same-node peers read it here, and it is the source of the puts to other
    // nodes (unchanged until the call ends, when the proxy's quiet has delivered them).
    CallMeta& me = mine->meta;
    copy_meta(&me, &meta);
    me.epoch = e;
    const char* op_name = layer0 ? "comet.moe_layer0: " : "comet.moe_layer1: ";
    const unsigned long long bad_slot = p.ids != nullptr ? st->first_bad_id : ~0ull;
    if (me.error == 0 && bad_slot != ~0ull) {
      const int64_t i = int64_t(bad_slot);
      Message(me.message, int(sizeof(me.message)))
          << op_name << "topk_ids[" << i / p.topk << ", " << i % p.topk
          << "] = " << int64_t(p.ids[i]) << " is not an expert id: valid ids are 0.."
          << int64_t(p.num_experts - 1) << " and -1 (dropped slot)";
      me.error = 1;
    }
    if (me.error == 0 && !layer0 && rows >= 0) {
      // What the group's verdict checks against the routing (routing_matches_layouts).
      me.routed_rows = int64_t(st->routed_rows);
      me.layout_rows = rows;
    }
    if (me.error == 0 && !layer0 && (rows < 0 || (p.max_rows < 0 ? rows != p.h_rows
                                                                  : rows > p.h_rows))) {
      // With max_rows, h has max_rows rows (checked on the host) and holds the first M of them.
      Message m(me.message, int(sizeof(me.message)));
      m << op_name << "h has " << p.h_rows << " rows but the layout dispatches ";
      if (rows < 0)
        m << "a negative row count";
      else
        m << rows;
      if (p.max_rows >= 0) m << " (more than max_rows = " << p.max_rows << ")";
      m << ": pass the layout moe_layer0 returned with this h";
      me.error = 1;
    }
  }
  const bool publish_buckets = layer0 && meta.error == 0;
  if (publish_buckets) {
    // The send plan's bucket offsets are published at once (offset 0 of the data segment, which
    // does not depend on the segment's token capacity) so every destination can size its
    // dispatch layout during this exchange.
    int32_t* pub = reinterpret_cast<int32_t*>(p.datas[d] + p.regions.bucket_off);
    for (int64_t i = g; i <= p.num_experts; i += P) pub[i] = p.bucket[i];
  }
  grid_sync(ctx, sc.bar);

  // Metadata exchange, a peer per thread. A rank of another node gets (layer0) our bucket offsets
  // in its bucket box for us, then our metadata in its mailbox: both puts from the same thread,
  // so the metadata's signal follows the offsets on the link (FIFO per target).
  // A timed-out wait above (a peer still in an earlier call, or gone) publishes nothing: the
  // peers must not take this call for one of theirs (gpu_context.cuh: call_failed).
  if (g == 0 && !call_failed(p.error)) flag_release(mine->meta_epoch, e);
  for (int64_t r = g; r < W; r += P) {
    if (p.topo.same_node(d, int32_t(r))) continue;
    if (publish_buckets)
      put_signal(p, int32_t(r), bucket_box_of(p, d), p.datas[d] + p.regions.bucket_off,
                 size_t(p.num_experts + 1) * 4, nullptr, 0);
    put_signal(p, int32_t(r), header_meta_box(mine, W, d), &mine->meta, sizeof(CallMeta),
               header_flag(mine, W, PeerFlag::Meta, d), e);
  }
  for (int64_t s = g; s < W; s += P) {
    const bool near = p.topo.same_node(d, int32_t(s));
    spin_until(wc, announced(p, int32_t(s), &RankHeader::meta_epoch, PeerFlag::Meta), e,
               WaitSite::PeerMeta, s);
    copy_meta(&p.metas[s], near ? &p.headers[s]->meta : header_meta_box(mine, W, int32_t(s)));
  }
  grid_sync(ctx, sc.bar);

  if (g == 0) {
    int64_t max_tokens = 0;
    for (int32_t s = 0; s < W; ++s)
      max_tokens = p.metas[s].tokens > max_tokens ? p.metas[s].tokens : max_tokens;
    const int32_t bad = verdict(p.metas, W);
    st->bad_rank = bad;
    st->max_tokens = max_tokens;
    st->rows = 0;
    st->num_mtiles = 0;
    st->plan_entries = 0;
    st->plan_slots = 0;
    st->status = bad == -2 && !call_failed(p.error) ? int32_t(CallStatus::Ok)
                                                    : int32_t(CallStatus::Rejected);
  }
  grid_sync(ctx, sc.bar);
  int32_t status = st->status;

  if (status == int32_t(CallStatus::Ok) && layer0) {
    // Each source's bucket offsets: by pointer on this node, from our bucket box across nodes
    // (p.sources as scratch here: bases whose bucket_off region is the offsets to read; the
    // publish kernel sets the real source bases).
    for (int64_t s = g; s < W; s += P)
      p.sources[s] = p.topo.same_node(d, int32_t(s))
                         ? p.datas[s]
                         : bucket_box_of(p, int32_t(s)) - p.regions.bucket_off;
    grid_sync(ctx, sc.bar);
    rows = dispatch_layout_program(
        ctx, sc, DispatchLayoutArgs{p.sources, p.regions.bucket_off, d, W, El, p.recv_counts,
                                    p.expert_off, p.seg_off, false, p.tp});
    if (g == 0) {
      st->rows = rows;
      if (p.max_rows >= 0 && rows > p.max_rows) {
        // Local: this rank skips its GEMM and rows (peers are unaffected) and the next call, or
        // Buffer.check(), reports it.
        status = int32_t(CallStatus::RowsOverflow);
        record_overflow(p, kErrRowsOverflow, rows, p.max_rows);
      }
    }
  }
  if (g != 0) return;
  if (status == int32_t(CallStatus::Rejected) && p.max_rows >= 0) {
    // No host reads this call's verdict: keep it for the next call / Buffer.check().
    ErrorRecord* er = p.error;
    const int32_t bad = st->bad_rank;
    if (claim_error(er, kErrRejected)) {
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
                          p.row_bytes, 4, e, p.regions, p.ids};
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
    if (grid_rank(ctx) == 0) {  // (the dispatch layout: built by begin)
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
    // (no input reaches it: begin refused more rows than the workspace was sized for)
    if (grid_rank(ctx) == 0) workspace_overflow(p, Workspace::MTiles, s.small[El], p.mtiles_cap);
    return;
  }
  int64_t entries = 0;
  if (layer1) {
    const ReducePlanArgs<float> ra{p.plan_sources, d, W, p.topk, El, p.seg_off, p.plan_cap,
                                   p.plan, &st->plan_slots,
                                   p.topo.reduce_rpn(), p.tp};
    entries = reduce_plan_program(ctx, s, ra);
    // The peers' routing must send exactly the layout's M rows (expert_off[E_local], from
    // recv_counts): more would overrun the plan (its room is h's rows), fewer leave rows of h
    // unread. Else the call fails here, as on the CPU backend: the layout does not match.
    const int64_t M = p.expert_off[El];
    if (entries < 0 || st->plan_slots != M) {
      if (grid_rank(ctx) == 0)
        workspace_overflow(p,
                           entries == kPlanEntriesOverflow ? Workspace::PlanEntries
                                                           : Workspace::PlanSlots,
                           st->plan_slots, M);
      return;
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

// Blocks of a prologue kernel that can be resident at once on this device (its occupancy with
// kThreads threads and its static shared memory, times the SMs the call's sm_margin leaves): the
// grid barrier needs them all.
int coresident_blocks(const void* kernel, int sm_margin) {
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess)
    return 1;
  sms -= sm_margin;
  return per_sm * sms > 1 ? per_sm * sms : 1;
}

// A prologue kernel with a grid barrier, launched cooperatively: the runtime schedules every block
// at once (or fails the launch) even while other kernels (the proxy on its side stream, another
// stream's work) hold SMs, and the grid is clamped to what can be co-resident. The programs take
// any grid size, and the scratch was sized for the larger `want`. No -rdc is needed: the barrier is
// the engine's own (parallel.h), not cooperative_groups' grid sync.
template <class... Args>
void launch_grid_program(void (*kernel)(Args...), int want, int sm_margin, cudaStream_t stream,
                         const Args&... args) {
  const int cap = coresident_blocks(reinterpret_cast<const void*>(kernel), sm_margin);
  const int blocks = want < 1 ? 1 : (want < cap ? want : cap);
  void* argv[] = {const_cast<void*>(static_cast<const void*>(&args))...};
  // An error is left for the caller's cudaGetLastError (the runtime records it there too).
  (void)cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(blocks),
                                    dim3(kThreads), argv, 0, stream);
}

// Grid of the begin kernel: its parallel loops are over the W peers and the E_local x (W+1)
// layout cells (about 16 per thread), within the scratch the op sized for source_blocks (layer1:
// the larger of the two grids).
int begin_blocks(const CallParams& p) {
  const int64_t cells = int64_t(p.experts_local) * (p.world + 1);
  const int64_t items = cells > p.world ? cells : p.world;
  const int64_t want = (items + int64_t(kThreads) * 16 - 1) / (int64_t(kThreads) * 16);
  const int64_t room = p.op == int32_t(OpKind::Layer0)
                           ? p.source_blocks
                           : (p.source_blocks > p.plan_blocks ? p.source_blocks : p.plan_blocks);
  return int(want < room ? want : (room > 1 ? room : 1));
}

}  // namespace

void launch_source(const CallParams& p, cudaStream_t stream) {
  if (p.ids == nullptr) return;  // rejected on the host: nothing to plan
  launch_grid_program(source_kernel, p.source_blocks, p.sm_margin, stream, p);
}

void launch_begin(const CallParams& p, const CallMeta& me, cudaStream_t stream) {
  launch_grid_program(begin_kernel, begin_blocks(p), p.sm_margin, stream, p, me);
}

void launch_publish(const CallParams& p, cudaStream_t stream) {
  launch_grid_program(publish_kernel, p.plan_blocks, p.sm_margin, stream, p);
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
