// Ranks as threads of this process over real symmetric heaps running both fused layers of the CPU
// backend (csrc/cpu/fused_cpu.h) on a random small problem: shared by test_fused.cpp (against an
// fp64 oracle, across team sizes, splits and delays) and test_residency.cpp (bitwise across
// residency limits).
#pragma once

#include <unistd.h>

#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu/fused_cpu.h"

namespace fused_world {

using namespace comet;

struct Rank {
  int64_t tokens;
  std::vector<float> x, w0, w1, weights;  // x [T,H], w0 [El,N,H], w1 [El,H,N], weights [T,k]
  std::vector<int32_t> ids;               // [T,k]
};

struct Result {
  std::vector<float> y0, out;
  std::vector<int32_t> row_source, row_token, row_slot;
};

struct Problem {
  int32_t W, El, k;
  int64_t H, N;
  std::vector<Rank> ranks;
};

inline Problem make_problem(std::mt19937& rng, int32_t W) {
  Problem p{W, 1 + int32_t(rng() % 3), 1 + int32_t(rng() % 3), 3 + int64_t(rng() % 14),
            2 + int64_t(rng() % 9), {}};
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int32_t E = W * p.El;
  for (int32_t r = 0; r < W; ++r) {
    Rank rk;
    rk.tokens = (rng() % 4 == 0) ? 0 : int64_t(rng() % 13);  // empty ranks now and then
    rk.x.resize(size_t(rk.tokens * p.H));
    rk.w0.resize(size_t(p.El * p.N * p.H));
    rk.w1.resize(size_t(p.El * p.H * p.N));
    rk.weights.resize(size_t(rk.tokens * p.k));
    rk.ids.resize(size_t(rk.tokens * p.k));
    for (auto* v : {&rk.x, &rk.w0, &rk.w1, &rk.weights})
      for (float& f : *v) f = u(rng);
    for (int32_t& e : rk.ids) e = int32_t(rng() % (E + 1)) - 1;  // -1: dropped slot
    p.ranks.push_back(std::move(rk));
  }
  return p;
}

inline CallMeta meta(OpKind op, const Problem& p, int64_t tokens) {
  CallMeta m{};
  m.op = int32_t(op);
  m.world = p.W;
  m.group_hash = 11;
  m.num_experts = p.W * p.El;
  m.topk = p.k;
  m.hidden = int32_t(p.H);
  m.cols = int32_t(p.N);
  m.dtype = int32_t(ScalarKind::F32);
  m.tokens = tokens;
  return m;
}

// Rank r's two layers; h = y0 (no activation, so the oracle stays short).
inline Result run_rank(cpu::SymmHeap& heap, const Problem& p, int32_t r, const cpu::CpuLaunch& l) {
  const Rank& rk = p.ranks[size_t(r)];
  Result res;
  std::vector<int32_t> send_pos(rk.ids.size()), recv_counts(size_t(p.W * p.El));
  const uint64_t e0 = heap.begin_call(meta(OpKind::Layer0, p, rk.tokens));
  CHECK(heap.verdict("layer0").empty());
  const cpu::Layer0Problem p0{rk.x.data(), rk.w0.data(), rk.ids.data(), ScalarKind::F32,
                              rk.tokens, p.H, p.N, p.W * p.El, p.k};
  cpu::Layer0Call call(heap, e0, p0, l, send_pos.data(), recv_counts.data());
  const int64_t M = call.rows();
  std::vector<float> a(size_t(M * p.H));
  res.y0.resize(size_t(M * p.N));
  res.row_source.resize(size_t(M));
  res.row_token.resize(size_t(M));
  res.row_slot.resize(size_t(M));
  call.run(a.data(), res.y0.data(), res.row_source.data(), res.row_token.data(),
           res.row_slot.data());
  heap.end_call(e0);

  const uint64_t e1 = heap.begin_call(meta(OpKind::Layer1, p, rk.tokens));
  CHECK(heap.verdict("layer1").empty());
  const cpu::Layer1Problem<float> p1{res.y0.data(), rk.w1.data(), rk.weights.data(),
                                     rk.ids.data(), send_pos.data(), recv_counts.data(),
                                     ScalarKind::F32, rk.tokens, M, p.N, p.H, p.W * p.El, p.k};
  std::vector<float> c(size_t(M * p.H));
  res.out.resize(size_t(rk.tokens * p.H));
  cpu::layer1_call<float>(heap, e1, p1, l, c.data(), res.out.data());
  heap.end_call(e1);
  return res;
}

inline std::vector<Result> run_world(std::vector<std::unique_ptr<cpu::SymmHeap>>& heaps,
                              const Problem& p, const cpu::CpuLaunch& l) {
  std::vector<Result> res(size_t(p.W));
  std::vector<std::thread> ts;
  for (int32_t r = 0; r < p.W; ++r)
    ts.emplace_back([&, r] {
      cpu::CpuLaunch lr = l;
      if (lr.stress_seed) lr.stress_seed += uint64_t(r);
      res[size_t(r)] = run_rank(*heaps[size_t(r)], p, r, lr);
    });
  for (auto& t : ts) t.join();
  return res;
}

// W heaps of one group (ranks_per_node 0: one node; else nodes of that many ranks, linked by the
// proxy with a short latency), connected.
inline std::vector<std::unique_ptr<cpu::SymmHeap>> make_world(int32_t W, const std::string& job,
                                                              int32_t ranks_per_node = 0) {
  std::vector<std::unique_ptr<cpu::SymmHeap>> heaps;
  for (int32_t r = 0; r < W; ++r)
    heaps.push_back(std::make_unique<cpu::SymmHeap>(r, W, job, 11, 30.0, ranks_per_node,
                                                    cpu::LinkSettings{5.0, 0.0}));
  for (auto& h : heaps) h->connect();
  for (auto& h : heaps) h->unlink_own();
  return heaps;
}

}  // namespace fused_world
