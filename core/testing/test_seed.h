// The seed of a test's random inputs: SHARDSERVE_TEST_SEED when set (to replay a failure), else a
// fresh one; printed either way, once per test binary.
#ifndef SHARDSERVE_CORE_TESTING_TEST_SEED_H_
#define SHARDSERVE_CORE_TESTING_TEST_SEED_H_

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

namespace shardserve::core {

inline uint64_t TestSeed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("SHARDSERVE_TEST_SEED");
    const uint64_t s = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::cout << "SHARDSERVE_TEST_SEED=" << s << std::endl;
    return s;
  }();
  return seed;
}

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TESTING_TEST_SEED_H_
