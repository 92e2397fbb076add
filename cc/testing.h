// The test harness shared by the C++ tests of the kernels (cc/*_test.cc and
// cc/cuda/*_cuda_test.cc). No gtest: the extension's build stays free of
// third-party test dependencies, and this is all the tests need.
//
//   CHECK(cond)                          cond is true.
//   EXPECT_NEAR(actual, expected, tol)   |actual - expected| <= tol (as
//   doubles;
//                                        a NaN on either side fails).
//   EXPECT_THROW_MSG(stmt, Exc, substr)  stmt throws Exc whose what() contains
//                                        substr.
//   EXPECT_INVALID_ARGUMENT(stmt, substr)  the same for std::invalid_argument.
//   ADD_FAILURE(format, ...)             a failure with a printf-style message.
//
// A failing check prints "<file>:<line>: <what>" to stderr and counts against
// the test case being run; the case goes on (every failure of a case is
// reported, not only the first). RunTests runs the cases in order, prints
// "[PASS] <name>" or "[FAIL] <name>" for each, then the closing line
// "<suite>: N passed, M failed" (CI reads that line: keep its format), and
// returns the process exit code (0 only when no case failed). A case that
// throws fails with the exception's message.
//
// Not covered: fatal checks (a check never stops its case: guard what would
// crash after a failure yourself), death tests, and filtering cases by name.

#ifndef DOCKYARD_CC_TESTING_H_
#define DOCKYARD_CC_TESTING_H_

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dockyard::testing {

// Failed checks in the test case being run; RunTests resets it per case.
inline int& CaseFailures() {
  static int num_failures = 0;
  return num_failures;
}

// Prints "<file>:<line>: <message>" to stderr and counts a failure.
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
inline void AddFailure(const char* file, int line, const char* format, ...) {
  std::fprintf(stderr, "%s:%d: ", file, line);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  ++CaseFailures();
}

// Whether `message` contains `substr` (a std::string or a C string).
inline bool Contains(const char* message, const std::string& substr) {
  return std::string(message).find(substr) != std::string::npos;
}

struct TestCase {
  std::string name;
  std::function<void()> fn;
};

// Runs `tests` in order and prints the results (see the file comment); returns
// main()'s exit code.
inline int RunTests(const char* suite, const std::vector<TestCase>& tests) {
  int passed = 0, failed = 0;
  for (const TestCase& test : tests) {
    CaseFailures() = 0;
    try {
      test.fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", test.name.c_str(),
                   e.what());
      ++CaseFailures();
    } catch (...) {
      std::fprintf(stderr, "%s: unexpected exception of a non-std type\n",
                   test.name.c_str());
      ++CaseFailures();
    }
    const bool ok = CaseFailures() == 0;
    std::printf("[%s] %s\n", ok ? "PASS" : "FAIL", test.name.c_str());
    // Failures go to unbuffered stderr; flushing keeps each case's line right
    // after them when both streams go to one log.
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  std::printf("%s: %d passed, %d failed\n", suite, passed, failed);
  return failed == 0 ? 0 : 1;
}

// Test data shared by a kernel's CPU test and its CUDA parity test.

// Deterministic pseudo-random bytes (xorshift; no <random> distribution,
// whose output differs across standard libraries).
inline void FillPseudoRandom(std::vector<char>* bytes, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (char& b : *bytes) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<char>(x >> 24);
  }
}

// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN.
inline uint16_t ToBf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace dockyard::testing

#define ADD_FAILURE(...) \
  ::dockyard::testing::AddFailure(__FILE__, __LINE__, __VA_ARGS__)

#define CHECK(cond)                           \
  do {                                        \
    if (!(cond)) {                            \
      ADD_FAILURE("CHECK failed: %s", #cond); \
    }                                         \
  } while (0)

#define EXPECT_NEAR(actual, expected, tol)                                \
  do {                                                                    \
    const double a_ = (actual), e_ = (expected), t_ = (tol);              \
    if (!(std::fabs(a_ - e_) <= t_)) {                                    \
      ADD_FAILURE(                                                        \
          "EXPECT_NEAR failed: %s = %.9g, expected %s = %.9g (tolerance " \
          "%.3g)",                                                        \
          #actual, a_, #expected, e_, t_);                                \
    }                                                                     \
  } while (0)

// `stmt` must throw `Exc` whose message contains `substr`. Put `stmt` in
// parentheses when it has a top-level comma (a braced list).
#define EXPECT_THROW_MSG(stmt, Exc, substr)                                \
  do {                                                                     \
    bool thrown_ = false;                                                  \
    try {                                                                  \
      stmt;                                                                \
    } catch (const Exc& exc_) {                                            \
      thrown_ = true;                                                      \
      const std::string substr_(substr);                                   \
      if (!::dockyard::testing::Contains(exc_.what(), substr_)) {          \
        ADD_FAILURE("message \"%s\" does not contain \"%s\"", exc_.what(), \
                    substr_.c_str());                                      \
      }                                                                    \
    }                                                                      \
    if (!thrown_) {                                                        \
      ADD_FAILURE("expected %s from: %s", #Exc, #stmt);                    \
    }                                                                      \
  } while (0)

#define EXPECT_INVALID_ARGUMENT(stmt, substr) \
  EXPECT_THROW_MSG(stmt, std::invalid_argument, substr)

#endif  // DOCKYARD_CC_TESTING_H_
