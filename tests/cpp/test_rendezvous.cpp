// comet::Rendezvous (csrc/rendezvous.h), the simulated CUDA world's collectives: W threads meet
// many times with random delays; each meeting's action runs once, after every rank arrived and
// before any left, and every rank gets its result; a rank that stays away fails the meeting,
// naming it, and every later one.
#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "rendezvous.h"

using namespace comet;

namespace {

void meetings_run_their_action_once_with_everyone_there(int32_t world, int rounds) {
  Rendezvous meet(world, 30.0, "test");
  std::atomic<int32_t> inside{0};  // ranks between arriving and leaving the current meeting
  std::vector<std::atomic<int32_t>> actions(static_cast<size_t>(rounds));
  std::vector<std::vector<intptr_t>> got(static_cast<size_t>(world),
                                          std::vector<intptr_t>(static_cast<size_t>(rounds)));
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      std::mt19937 rng(uint32_t(17 + r));
      for (int i = 0; i < rounds; ++i) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
        ++inside;
        void* res = meet.meet(r, "a round", [&, i]() -> void* {
          CHECK(inside.load() == world);  // everyone arrived, nobody left yet
          ++actions[size_t(i)];
          return reinterpret_cast<void*>(intptr_t(1000 + i));
        });
        --inside;
        got[size_t(r)][size_t(i)] = reinterpret_cast<intptr_t>(res);
        // a plain barrier between rounds: nobody starts round i + 1 before all left round i
        meet.meet(r, "a barrier", nullptr);
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < rounds; ++i) {
    CHECK(actions[size_t(i)].load() == 1);
    for (int32_t r = 0; r < world; ++r) CHECK(got[size_t(r)][size_t(i)] == 1000 + i);
  }
}

void a_missing_rank_fails_the_meeting_by_name_and_every_later_one() {
  Rendezvous meet(3, 0.2, "test");
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < 2; ++r)  // rank 2 never comes
    threads.emplace_back([&, r] {
      try {
        meet.meet(r, "a symmetric allocation", nullptr);
      } catch (const std::runtime_error& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    CHECK(e.find("rank(s) 2 did not reach a symmetric allocation within 0.2 s") !=
          std::string::npos);
  }
  bool refused = false;
  try {
    meet.meet(2, "a barrier", nullptr);  // too late: the group is unusable
  } catch (const std::runtime_error& e) {
    refused = std::string(e.what()).find("rank(s) 2 did not reach") != std::string::npos;
  }
  CHECK(refused);
}

void a_rank_outside_the_group_is_refused() {
  Rendezvous meet(2, 1.0, "test");
  bool refused = false;
  try {
    meet.meet(2, "a barrier", nullptr);
  } catch (const std::invalid_argument& e) {
    refused = std::string(e.what()).find("rank 2 cannot meet") != std::string::npos;
  }
  CHECK(refused);
}

}  // namespace

int main() {
  meetings_run_their_action_once_with_everyone_there(1, 5);
  meetings_run_their_action_once_with_everyone_there(2, 200);
  meetings_run_their_action_once_with_everyone_there(4, 200);
  meetings_run_their_action_once_with_everyone_there(7, 50);
  a_missing_rank_fails_the_meeting_by_name_and_every_later_one();
  a_rank_outside_the_group_is_refused();
  TEST_MAIN_END
}
