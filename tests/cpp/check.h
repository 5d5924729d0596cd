// A minimal check macro for the C++ unit tests (no test framework dependency).
#pragma once
#include <atomic>
#include <cstdio>
#include <cstdlib>

inline std::atomic<int> g_failures{0};  // CHECK may run on several threads
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)
#define TEST_MAIN_END                                                          \
  if (g_failures) std::fprintf(stderr, "%d check(s) failed\n", g_failures.load());    \
  return g_failures ? 1 : 0;
