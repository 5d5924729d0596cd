// The readiness protocol: self-resetting arrival counters under real concurrency, the symmetric
// heap's per-call handshake (metadata agreement, verdict on disagreement, data segment growth)
// across ranks run as threads, and the error a rank's exit leaves on ranks that never waited for
// it.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "comet/symm_layout.h"
#include "comet/flags.h"
#include "comet/gemm_schedule.h"
#include "cpu/symm_heap.h"

using namespace comet;

static void arrivals() {
  constexpr int kThreads = 4, kRounds = 2000;
  uint32_t counter = 0;
  uint64_t flag = 0;
  std::atomic<int> publishers{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&] {
      for (int r = 1; r <= kRounds; ++r) {
        // wait for the previous round to be published before arriving again (as the next call
        // of a kernel starts only after the previous one ended)
        while (flag_acquire(&flag) < uint64_t(r - 1)) std::this_thread::yield();
        if (arrive_and_publish(&counter, kThreads, &flag, uint64_t(r))) ++publishers;
      }
    });
  for (auto& t : ts) t.join();
  CHECK(publishers.load() == kRounds);  // exactly one publisher per round
  CHECK(flag == kRounds);
  CHECK(counter == 0);
}

static void heap_handshake() {
  constexpr int W = 3;
  const std::string job = "ctest" + std::to_string(::getpid());
  std::vector<std::unique_ptr<cpu::SymmHeap>> heaps;
  for (int r = 0; r < W; ++r) heaps.push_back(std::make_unique<cpu::SymmHeap>(r, W, job, 7, 10.0));
  for (auto& h : heaps) h->connect();
  for (auto& h : heaps) h->unlink_own();
  std::vector<std::string> verdicts(W);
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      for (int call = 0; call < 50; ++call) {
        CallMeta m{};
        m.world = W;
        m.group_hash = 7;
        m.num_experts = 6;
        m.topk = 2;
        m.hidden = (call == 10 && r == 2) ? 9 : 8;  // one call where rank 2 disagrees
        m.tokens = r + call;
        const uint64_t e = heaps[r]->begin_call(m);
        CHECK(e == uint64_t(call + 1));
        const std::string v = heaps[r]->verdict("test");
        if (call == 10) verdicts[r] = v;
        else CHECK(v.empty());
        heaps[r]->reserve(size_t(1000) * (call + 1));  // grows every call, collectively
        char* mine = heaps[r]->data(r);
        mine[0] = char(r + call);
        heaps[r]->end_call(e);
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < W; ++r) CHECK(verdicts[r].find("disagree on the hidden size") != std::string::npos);
}

// The CUDA buffer's re-arm reads a peer's line (flag, then state) with copies whose word order is
// unspecified: the state it returns must come from a copy made after the flag was seen, never
// from the copy that first saw it (which may hold words from before the peer's state put).
static void rearm_state_read_after_the_flag() {
  const uint64_t target = 5;
  const RearmState stale{1, 1, 1}, fresh{4, 2, 1 << 20};
  int reads = 0;
  auto read = [&](uint64_t* line) {  // flag seen on the 3rd copy, whose state words are stale
    ++reads;
    line[0] = reads < 3 ? target - 1 : target;
    const RearmState& st = reads <= 3 ? stale : fresh;
    memcpy(line + 1, &st, sizeof(st));
  };
  int polls = 0;
  RearmState got{};
  CHECK(poll_rearm_line(read, target, [&] { return ++polls > 100; }, &got));
  CHECK(got.epoch == fresh.epoch && got.gen == fresh.gen && got.capacity == fresh.capacity);
  CHECK(reads == 4);
  // a peer that never raises its flag: the poll gives up when told to
  reads = -1000;
  polls = 0;
  CHECK(!poll_rearm_line(read, target, [&] { return ++polls > 5; }, &got));
  CHECK(polls == 6);
}

// Rank 2 of 3 has exited (its header holds the pid of a reaped child process). Rank 1 notices it
// (waiting for rank 2) and fails its call; rank 0, waiting only for rank 1, stops at once on rank
// 1's fault, and its error names rank 2, the root cause, not rank 1: the fault carries the dead
// rank (word 1 of rank 1's Fault line in rank 0's header).
static void dead_rank_named_by_every_rank() {
  constexpr int W = 3;
  const std::string job = "ctest-dead" + std::to_string(::getpid());
  std::vector<std::unique_ptr<cpu::SymmHeap>> heaps;
  for (int r = 0; r < W; ++r) heaps.push_back(std::make_unique<cpu::SymmHeap>(r, W, job, 7, 10.0));
  for (auto& h : heaps) h->connect();
  for (auto& h : heaps) h->unlink_own();
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  CHECK(child > 0);
  ::waitpid(child, nullptr, 0);  // gone: kill(pid, 0) fails with ESRCH
  flag_release(heaps[2]->header(2)->pid, uint64_t(child));
  const std::string dead = "rank 2 (pid " + std::to_string(child) + ") has exited";

  std::string survivor;
  std::thread rank0([&] {
    try {  // rank 1's metadata, which never comes
      heaps[0]->wait(header_flag(heaps[0]->header(0), W, PeerFlag::Meta, 1), 1,
                     WaitSite::PeerMeta, 1);
    } catch (const std::exception& e) {
      survivor = e.what();
    }
  });
  std::string noticer;
  try {
    heaps[1]->wait(header_flag(heaps[1]->header(1), W, PeerFlag::Meta, 2), 1, WaitSite::PeerMeta,
                   2);
  } catch (const std::exception& e) {
    noticer = e.what();
    heaps[1]->mark_broken(noticer);  // as a failed call does (ops_cpu.cpp: guarded_call)
  }
  rank0.join();
  CHECK(noticer.find(dead) != std::string::npos);
  CHECK(survivor.find(dead) != std::string::npos);
  CHECK(survivor.find("rank 1 noticed it and stopped this call") != std::string::npos);
  CHECK(header_flag(heaps[0]->header(0), W, PeerFlag::Fault, 1)[1] == 3);  // 1 + the dead rank
  if (survivor.find(dead) == std::string::npos)
    std::fprintf(stderr, "rank 0: %s\n", survivor.c_str());
}

// layer0's walk with the wait handed to the tile's work (the sm_90a producer's weights before
// rows): every tile of the schedule, in order, gets exactly one wait for its own m-tile, issued
// where the work calls it; layer0_gemm, built on it, waits before each tile's work.
struct RecordingCtx {
  std::vector<std::string>* log;
  void wait(uint64_t*, uint64_t, WaitSite, int64_t index) {
    log->push_back("wait " + std::to_string(index));
  }
  void delay() {}
};

static void layer0_wait_handed_to_the_tile() {
  const int64_t n_m = 5;
  const int32_t n_n = 3, blocks = 2;
  std::vector<MTile> mtiles;
  for (int64_t m = 0; m < n_m; ++m) mtiles.push_back(MTile{m * 4, 4, int32_t(m % 2)});
  std::vector<int64_t> order = {3, 0, 4, 1, 2};
  std::vector<uint64_t> ready(n_m, 0);
  GemmScheduleArgs a{};
  a.epoch = 1;
  a.mtiles = mtiles.data();
  a.num_mtiles = n_m;
  a.num_ntiles = n_n;
  a.mtile_order = order.data();
  a.mtile_ready = ready.data();
  for (int32_t g = 0; g < blocks; ++g) {
    std::vector<std::string> deferred, plain, want;
    RecordingCtx c1{&deferred}, c2{&plain};
    layer0_gemm_deferred(c1, g, blocks, a, [&](const MTile& mt, int32_t nt, auto&& wait) {
      deferred.push_back("weights " + std::to_string(mt.row_begin) + "," + std::to_string(nt));
      wait();
      deferred.push_back("rows " + std::to_string(mt.row_begin) + "," + std::to_string(nt));
    });
    layer0_gemm(c2, g, blocks, a, [&](const MTile& mt, int32_t nt) {
      plain.push_back("rows " + std::to_string(mt.row_begin) + "," + std::to_string(nt));
    });
    int tiles = 0;
    for (int64_t i = g; i < n_m * n_n; i += blocks, ++tiles) {
      const TileCoord tc = schedule_tile(0, i, a, blocks);
      const std::string at = std::to_string(tc.mtile * 4) + "," + std::to_string(tc.ntile);
      want.push_back("weights " + at);
      want.push_back("wait " + std::to_string(tc.mtile));
      want.push_back("rows " + at);
    }
    CHECK(tiles > 0);
    CHECK(deferred == want);
    std::vector<std::string> want_plain;
    for (const auto& w : want)
      if (w.rfind("weights", 0) != 0) want_plain.push_back(w);
    CHECK(plain == want_plain);
  }
}

int main() {
  layer0_wait_handed_to_the_tile();
  rearm_state_read_after_the_flag();
  arrivals();
  heap_handshake();
  dead_rank_named_by_every_rank();
  TEST_MAIN_END
}
