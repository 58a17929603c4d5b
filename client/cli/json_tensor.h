// Tensors as JSON nested arrays for the CLI: "[[1, 2], [3, 4]]" <-> shape [2, 2] + values.
#ifndef SHARDSERVE_CLIENT_CLI_JSON_TENSOR_H_
#define SHARDSERVE_CLIENT_CLI_JSON_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::client {

struct JsonArray {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

// Parses a (possibly nested) JSON array of numbers; it must be rectangular. INVALID_ARGUMENT
// names the position of the problem.
absl::StatusOr<JsonArray> ParseJsonArray(absl::string_view text);
// Formats values as nested arrays of the given shape.
std::string FormatJsonArray(const std::vector<int64_t>& shape, const std::vector<float>& values);

}  // namespace shardserve::client

#endif  // SHARDSERVE_CLIENT_CLI_JSON_TENSOR_H_
