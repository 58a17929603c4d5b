#include "core/base/device.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardserve::core {

absl::StatusOr<Device> Device::Parse(absl::string_view text) {
  Device device;
  if (text == "cpu") return device;
  if (absl::StartsWith(text, "cuda:")) {
    int index = -1;
    if (!absl::SimpleAtoi(text.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device: cannot parse \"", text, "\": expected cuda:<index> with index >= 0"));
    }
    device.kind = Kind::kCuda;
    device.index = index;
    return device;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "device: cannot parse \"", text, "\": expected \"cpu\" or \"cuda:<index>\""));
}

std::string Device::ToString() const {
  return kind == Kind::kCpu ? "cpu" : absl::StrCat("cuda:", index);
}

}  // namespace shardserve::core
