// The CPU backend's fused layers (csrc/cpu/fused_cpu.h) without torch: ranks as threads of this
// process over real symmetric heaps, blocks as thread teams of 1, 2 and 4 threads. Checks every
// output against a sequential fp64 oracle written from docs/design.md's semantics, and that team sizes,
// block splits and random delays never change a bit. Small on purpose: the ThreadSanitizer build
// runs it too (make test-tsan).
#include <cmath>

#include "fused_world.h"

using namespace comet;
using namespace fused_world;

namespace {

bool close(double got, double want) { return std::fabs(got - want) <= 1e-4 + 1e-4 * std::fabs(want); }

// Sequential oracle: each dispatched row's origin and y0, and each token's combined output.
void check_oracle(const Problem& p, const std::vector<Result>& res) {
  const int32_t E = p.W * p.El;
  for (int32_t d = 0; d < p.W; ++d) {
    const Result& rd = res[size_t(d)];
    // Rows by local expert, then source in ring order from d, then token, then slot.
    int64_t row = 0;
    for (int32_t e = 0; e < p.El; ++e)
      for (int32_t i = 0; i < p.W; ++i) {
        const int32_t s = (d + i) % p.W;
        const Rank& rs = p.ranks[size_t(s)];
        for (int64_t t = 0; t < rs.tokens; ++t)
          for (int32_t j = 0; j < p.k; ++j) {
            if (rs.ids[size_t(t * p.k + j)] != d * p.El + e) continue;
            CHECK(row < int64_t(rd.row_source.size()));
            if (row >= int64_t(rd.row_source.size())) return;
            CHECK(rd.row_source[size_t(row)] == s && rd.row_token[size_t(row)] == t &&
                  rd.row_slot[size_t(row)] == j);
            for (int64_t n = 0; n < p.N; ++n) {
              double acc = 0;
              for (int64_t h = 0; h < p.H; ++h)
                acc += double(rs.x[size_t(t * p.H + h)]) *
                       double(p.ranks[size_t(d)].w0[size_t((e * p.N + n) * p.H + h)]);
              CHECK(close(rd.y0[size_t(row * p.N + n)], acc));
            }
            ++row;
          }
      }
    CHECK(row == int64_t(rd.row_source.size()));
  }
  for (int32_t s = 0; s < p.W; ++s) {
    const Rank& rs = p.ranks[size_t(s)];
    for (int64_t t = 0; t < rs.tokens; ++t)
      for (int64_t h = 0; h < p.H; ++h) {
        double acc = 0;
        for (int32_t j = 0; j < p.k; ++j) {
          const int32_t e = rs.ids[size_t(t * p.k + j)];
          if (e < 0 || e >= E) continue;
          const Rank& rd = p.ranks[size_t(e / p.El)];
          double dot = 0;
          for (int64_t n = 0; n < p.N; ++n) {
            double y = 0;
            for (int64_t q = 0; q < p.H; ++q)
              y += double(rs.x[size_t(t * p.H + q)]) * double(rd.w0[size_t(((e % p.El) * p.N + n) * p.H + q)]);
            dot += double(float(y)) * double(rd.w1[size_t(((e % p.El) * p.H + h) * p.N + n)]);
          }
          acc += double(rs.weights[size_t(t * p.k + j)]) * dot;
        }
        CHECK(close(res[size_t(s)].out[size_t(t * p.H + h)], acc));
      }
  }
}

// layer1's reduction order exactly as docs/design.md states it ("The layer1 reduction order";
// tests/layer1_order.py is the same statement in Python), in fp32, compared bit for bit: the
// GEMM's dot product in 8 ascending lanes combined as a fixed tree; each sending rank's partial
// over its slots in ascending slot; node-reduced (reduce_rpn > 0), a node's partials summed in
// ascending rank; the home adding the partials in ascending rank (a reduced node at its first
// rank). The other bitwise checks compare the op with itself and miss an order changed everywhere.
float lane_dot(const float* a, const float* b, int64_t k) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < k; ++i) lane[i % 8] += a[i] * b[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

void check_exact_order(const Problem& p, const std::vector<Result>& res, int32_t reduce_rpn) {
  auto row_of = [&](int32_t q, int32_t s, int64_t t, int32_t j) -> int64_t {
    const Result& rq = res[size_t(q)];
    for (size_t i = 0; i < rq.row_source.size(); ++i)
      if (rq.row_source[i] == s && rq.row_token[i] == t && rq.row_slot[i] == j) return int64_t(i);
    return -1;
  };
  for (int32_t s = 0; s < p.W; ++s) {
    const Rank& rs = p.ranks[size_t(s)];
    for (int64_t t = 0; t < rs.tokens; ++t) {
      std::vector<std::pair<int32_t, std::vector<float>>> parts;  // (key, partial) by key
      for (int32_t q = 0; q < p.W; ++q) {
        std::vector<float> acc(size_t(p.H), 0.f);
        bool any = false;
        for (int32_t j = 0; j < p.k; ++j) {
          const int32_t e = rs.ids[size_t(t * p.k + j)];
          if (e < 0 || e / p.El != q) continue;
          any = true;
          const int64_t row = row_of(q, s, t, j);
          CHECK(row >= 0);
          if (row < 0) return;
          for (int64_t h = 0; h < p.H; ++h)
            acc[size_t(h)] += rs.weights[size_t(t * p.k + j)] *
                              lane_dot(&res[size_t(q)].y0[size_t(row * p.N)],
                                       &p.ranks[size_t(q)].w1[size_t(((e % p.El) * p.H + h) * p.N)],
                                       p.N);
        }
        if (!any) continue;
        const bool relayed = reduce_rpn > 0 && q / reduce_rpn != s / reduce_rpn;
        const int32_t key = relayed ? q / reduce_rpn * reduce_rpn : q;
        if (!parts.empty() && parts.back().first == key)
          for (int64_t h = 0; h < p.H; ++h) parts.back().second[size_t(h)] += acc[size_t(h)];
        else
          parts.emplace_back(key, std::move(acc));
      }
      for (int64_t h = 0; h < p.H; ++h) {
        float acc = 0.f;
        for (const auto& kp : parts) acc += kp.second[size_t(h)];
        CHECK(res[size_t(s)].out[size_t(t * p.H + h)] == acc);
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(3);
  const std::string job = "ctestfused" + std::to_string(::getpid());
  for (int32_t W = 1; W <= 3; ++W) {
    auto heaps = make_world(W, job + "w" + std::to_string(W));
    for (int iter = 0; iter < 3; ++iter) {
      const Problem p = make_problem(rng, W);
      const std::vector<Result> base = run_world(heaps, p, cpu::CpuLaunch{1, 1, 4, 4, 1, 0});
      check_oracle(p, base);
      check_exact_order(p, base, 0);
      // fields: n_comm, n_gemm, tile, threads, stress seed, layer1's band (n-tiles per band;
      // 0 = all), residency (0 = all), raster group (0 = automatic); n_comm 0 = staged
      const cpu::CpuLaunch others[] = {{2, 2, 5, 3, 2, 0, 2},
                                       {1, 3, 3, 8, 4, 0, 0},
                                       {2, 1, 2, 2, 4, 17 + uint64_t(iter), 3},
                                       {0, 3, 2, 3, 2, 23 + uint64_t(iter), 0, 1, 2},
                                       {0, 1, 4, 4, 1, 0, 1, 0, 3},
                                       {1, 4, 1, 2, 2, 5 + uint64_t(iter), 2, 2, 3}};
      for (const cpu::CpuLaunch& l : others) {
        const std::vector<Result> got = run_world(heaps, p, l);
        for (int32_t r = 0; r < W; ++r) {  // bitwise: team size, split, tiles, bands, delays,
                                           // residency, raster groups, staged
          CHECK(got[size_t(r)].y0 == base[size_t(r)].y0);
          CHECK(got[size_t(r)].out == base[size_t(r)].out);
          CHECK(got[size_t(r)].row_token == base[size_t(r)].row_token);
        }
      }
    }
  }
  // Several nodes (the CPU analog: other nodes only through the link proxy), with teams and
  // delays, bitwise equal to one node: 2 nodes x 2 ranks, 3 nodes x 1 rank; node-reduced too.
  const std::pair<int32_t, int32_t> topologies[] = {{4, 2}, {3, 1}};
  for (const auto& [W, rpn] : topologies) {
    auto world = [&](int32_t per_node, const std::string& tag) {
      return make_world(W, job + tag + std::to_string(W), per_node);
    };
    auto one = world(W, "one"), nodes = world(rpn, "nodes"), reduced = world(rpn, "reduced");
    // Node-reduced combine (the relays sum their node's partials): the oracle's values, and the
    // same bits whatever the teams and delays.
    for (auto& h : reduced) h->set_node_reduce(true);
    for (int iter = 0; iter < 2; ++iter) {
      const Problem p = make_problem(rng, W);
      const std::vector<Result> base = run_world(one, p, cpu::CpuLaunch{2, 2, 5, 3, 2, 0});
      const std::vector<Result> got =
          run_world(nodes, p, cpu::CpuLaunch{2, 2, 5, 3, 2, 29 + uint64_t(iter), 2});
      for (int32_t r = 0; r < W; ++r) {
        CHECK(got[size_t(r)].y0 == base[size_t(r)].y0);
        CHECK(got[size_t(r)].out == base[size_t(r)].out);
        CHECK(got[size_t(r)].row_token == base[size_t(r)].row_token);
      }
      check_exact_order(p, got, 0);
      const std::vector<Result> red = run_world(reduced, p, cpu::CpuLaunch{2, 2, 5, 3, 2, 0});
      check_oracle(p, red);
      check_exact_order(p, red, rpn);
      const std::vector<Result> red2 =
          run_world(reduced, p, cpu::CpuLaunch{1, 3, 3, 8, 4, 41 + uint64_t(iter), 0});
      for (int32_t r = 0; r < W; ++r) CHECK(red2[size_t(r)].out == red[size_t(r)].out);
    }
  }
  TEST_MAIN_END
}
