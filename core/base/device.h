// Device: where a shard lives and a rank computes - the host CPU, or one CUDA device.
#ifndef SHARDSERVE_CORE_BASE_DEVICE_H_
#define SHARDSERVE_CORE_BASE_DEVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::core {

// Where a shard lives: "cpu" or "cuda" with an index.
struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // only meaningful for kCuda

  static absl::StatusOr<Device> Parse(absl::string_view text);
  std::string ToString() const;
  friend bool operator==(const Device& a, const Device& b) {
    return a.kind == b.kind && (a.kind == Kind::kCpu || a.index == b.index);
  }
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_BASE_DEVICE_H_
