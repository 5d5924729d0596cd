// Forward progress under a residency limit (csrc/cpu/block_runner.h, comet/block_roles.h): the CPU
// runner starts blocks in index order with at most S live, as a GPU does when another kernel
// shares its SMs; both fused layers (one node and two, node-reduced or not) finish under every S
// and give the bits of the unlimited run. Small on purpose: the ThreadSanitizer build runs it too
// (make test-tsan).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cpu/block_runner.h"
#include "fused_world.h"

using namespace comet;
using namespace fused_world;

namespace {

// Every block of both layers has exactly one role index, and every wait inside a kernel points to
// lower block indices: layer0's comm blocks come first, layer1's last.
void check_roles() {
  for (int32_t layer = 0; layer < 2; ++layer)
    for (int32_t blocks = 2; blocks <= 9; ++blocks)
      for (int32_t n_comm = 1; n_comm < blocks; ++n_comm) {
        std::vector<int32_t> comm_seen(size_t(n_comm), 0), gemm_seen(size_t(blocks - n_comm), 0);
        int32_t last_comm = -1, first_comm = blocks, last_gemm = -1, first_gemm = blocks;
        for (int32_t b = 0; b < blocks; ++b) {
          const BlockRole r = fused_block_role(layer, b, blocks, n_comm);
          CHECK(r.count == (r.comm ? n_comm : blocks - n_comm));
          CHECK(r.index >= 0 && r.index < r.count);
          if (r.index < 0 || r.index >= r.count) continue;
          ++(r.comm ? comm_seen : gemm_seen)[size_t(r.index)];
          (r.comm ? last_comm : last_gemm) = b;
          if (r.comm) first_comm = std::min(first_comm, b);
          else first_gemm = std::min(first_gemm, b);
        }
        for (int32_t c : comm_seen) CHECK(c == 1);
        for (int32_t g : gemm_seen) CHECK(g == 1);
        // layer0: GEMM waits on comm; layer1: comm waits on GEMM. The waited-on role is below.
        CHECK(layer == 0 ? last_comm < first_gemm : last_gemm < first_comm);
      }
  // Staged (n_comm = 0): two launches of the whole grid, the waited-on role's first (layer0 comm
  // then GEMM, layer1 GEMM then comm), so no launch waits on a later one; a fused layer is one.
  for (int32_t layer = 0; layer < 2; ++layer)
    for (int32_t blocks = 1; blocks <= 9; ++blocks) {
      CHECK(fused_steps(0) == 2 && fused_steps(1) == 1);
      const FusedStep first = fused_step(layer, 0, blocks, 0), second = fused_step(layer, 1, blocks, 0);
      CHECK(first.n_comm + first.n_gemm == blocks && second.n_comm + second.n_gemm == blocks);
      CHECK(layer == 0 ? (first.n_comm == blocks && second.n_gemm == blocks)
                       : (first.n_gemm == blocks && second.n_comm == blocks));
      CHECK(comm_program_blocks(blocks, 0) == blocks);
      for (int32_t n_comm = 1; n_comm < blocks; ++n_comm) {
        const FusedStep one = fused_step(layer, 0, blocks, n_comm);
        CHECK(one.n_comm == n_comm && one.n_gemm == blocks - n_comm);
        CHECK(comm_program_blocks(blocks, n_comm) == n_comm);
      }
    }
}

// At most S blocks live, started in index order: block b starts only once b - S + 1 blocks have
// finished (with S = 1, the bodies run in exactly index order).
void check_scheduling() {
  for (int32_t S : {1, 2, 3, 0}) {
    const int32_t blocks = 7, threads = 2;
    std::mutex m;
    std::vector<int32_t> started;
    std::atomic<int32_t> live{0}, most{0}, finished{0};
    cpu::run_teams(blocks, threads, S, [&](cpu::Team& team, int32_t b, int32_t t) {
      if (t == 0) {
        {
          std::lock_guard<std::mutex> lock(m);
          started.push_back(b);
        }
        if (S > 0) CHECK(finished.load() >= b - S + 1);
        const int32_t now = live.fetch_add(1) + 1;
        int32_t seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      team.arrive_and_wait();
      if (t == 0) {  // before the runner frees the slot
        live.fetch_sub(1);
        finished.fetch_add(1);
      }
    });
    std::sort(started.begin(), started.end());
    CHECK(int32_t(started.size()) == blocks);
    for (int32_t b = 0; b < int32_t(started.size()); ++b) CHECK(started[size_t(b)] == b);
    CHECK(most.load() <= (S > 0 ? S : blocks));
  }
  std::vector<int32_t> order;  // S = 1: one block at a time, in index order
  cpu::run_teams(5, 1, 1, [&](cpu::Team&, int32_t b, int32_t) { order.push_back(b); });
  CHECK((order == std::vector<int32_t>{0, 1, 2, 3, 4}));
  bool refused = false;
  try {  // a grid that waits on itself must be co-resident
    cpu::run_grid(nullptr, 4, 1, 0, [](cpu::CpuContext&) {}, nullptr, 3);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  CHECK(refused);
}

// A block waiting on a higher-index one is what the role layout rules out: under S = 1 it ends in
// the wait's timeout error, not a hang; the other way round it finishes.
void check_wait_directions() {
  auto heaps = make_world(1, "ctestres" + std::to_string(::getpid()));
  cpu::SymmHeap& heap = *heaps[0];
  heap.set_timeout(0.3);
  for (const bool upwards : {false, true}) {
    uint64_t flag = 0;
    const int32_t waiter = upwards ? 0 : 1, setter = upwards ? 1 : 0;
    std::string error;
    try {
      cpu::run_teams(2, 2, 1, [&](cpu::Team& team, int32_t b, int32_t t) {
        cpu::CpuContext ctx(&heap, team, b, 2, t, 0);
        if (b == waiter) ctx.wait(&flag, 1, WaitSite::ColumnTile, 0);
        if (b == setter && t == 0) flag_release(&flag, 1);
      });
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
    if (upwards)
      CHECK(error.find("gave up") != std::string::npos);
    else
      CHECK(error.empty());
  }
}

// Both fused layers under residency limits S, bitwise equal to the unlimited run.
void check_layers(std::vector<std::unique_ptr<cpu::SymmHeap>>& heaps, const Problem& p,
                  const std::vector<int32_t>& limits) {
  const cpu::CpuLaunch base_launch{2, 3, 3, 4, 2, 0};  // n_comm 2, 5 blocks in all
  const std::vector<Result> base = run_world(heaps, p, base_launch);
  for (int32_t S : limits) {
    cpu::CpuLaunch l = base_launch;
    l.resident = S;
    const std::vector<Result> got = run_world(heaps, p, l);
    for (int32_t r = 0; r < p.W; ++r) {
      CHECK(got[size_t(r)].y0 == base[size_t(r)].y0);
      CHECK(got[size_t(r)].out == base[size_t(r)].out);
      CHECK(got[size_t(r)].row_source == base[size_t(r)].row_source);
      CHECK(got[size_t(r)].row_token == base[size_t(r)].row_token);
    }
  }
}

}  // namespace

int main() {
  check_roles();
  check_scheduling();
  check_wait_directions();
  std::mt19937 rng(5);
  const std::string job = "ctestres" + std::to_string(::getpid());
  {  // one node: S = 1, 2 (n_comm), 3 (n_comm + 1), 5 (the whole grid)
    auto heaps = make_world(3, job + "one");
    check_layers(heaps, make_problem(rng, 3), {1, 2, 3, 5});
  }
  {  // two nodes of two ranks, partials sent per rank and node-reduced (the combine's relays)
    auto nodes = make_world(4, job + "nodes", 2), reduced = make_world(4, job + "reduced", 2);
    for (auto& h : reduced) h->set_node_reduce(true);
    const Problem p = make_problem(rng, 4);
    check_layers(nodes, p, {1, 3});
    check_layers(reduced, p, {1, 2});
  }
  TEST_MAIN_END
}
