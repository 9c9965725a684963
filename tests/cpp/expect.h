// EXPECT for the C++ test harnesses (tests/cpp/*.cpp): prints file:line and the condition,
// and counts the failure; the counter is atomic because some harnesses check from threads.
#pragma once
#include <atomic>
#include <cstdio>

static std::atomic<int> failures{0};
#define EXPECT(c)                                                          \
  do {                                                                     \
    if (!(c)) {                                                            \
      std::fprintf(stderr, "%s:%d: EXPECT(%s)\n", __FILE__, __LINE__, #c); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)
