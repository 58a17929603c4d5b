#include "client/cli/json_tensor.h"

#include <cctype>
#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"

namespace shardserve::client {
namespace {

class Parser {
 public:
  explicit Parser(absl::string_view text) : text_(text) {}

  absl::Status Parse(JsonArray* out) {
    SHARDSERVE_RETURN_IF_ERROR(Value(0, out));
    Space();
    if (pos_ != text_.size()) return Error("trailing characters");
    out->shape.assign(dims_.begin(), dims_.begin() + std::max<int64_t>(leaf_depth_, 0));
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON array: ", what, " at character ", pos_));
  }
  void Space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  absl::Status Value(size_t depth, JsonArray* out) {
    if (depth > 64) return Error("arrays nested deeper than 64");  // the stack stays small
    Space();
    if (pos_ < text_.size() && text_[pos_] == '[') {
      ++pos_;
      int64_t count = 0;
      Space();
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
      } else {
        while (true) {
          SHARDSERVE_RETURN_IF_ERROR(Value(depth + 1, out));
          ++count;
          Space();
          if (pos_ < text_.size() && text_[pos_] == ',') {
            ++pos_;
            continue;
          }
          if (pos_ < text_.size() && text_[pos_] == ']') {
            ++pos_;
            break;
          }
          return Error("expected ',' or ']'");
        }
      }
      if (dims_.size() <= depth) dims_.resize(depth + 1, -1);
      if (dims_[depth] == -1) {
        dims_[depth] = count;
      } else if (dims_[depth] != count) {
        return Error(absl::StrCat("ragged array: ", count, " entries where ", dims_[depth],
                                  " were seen before"));
      }
      if (count == 0) {
        if (leaf_depth_ >= 0 && leaf_depth_ != static_cast<int64_t>(depth) + 1) {
          return Error("ragged nesting");
        }
        leaf_depth_ = static_cast<int64_t>(depth) + 1;
      }
      return absl::OkStatus();
    }
    if (leaf_depth_ >= 0 && static_cast<int64_t>(depth) != leaf_depth_)
      return Error("ragged nesting");
    leaf_depth_ = static_cast<int64_t>(depth);
    const char* start = text_.data() + pos_;
    char* end = nullptr;
    const double v = std::strtod(start, &end);
    if (end == start) return Error("expected a number or '['");
    pos_ += end - start;
    out->values.push_back(v);
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
  int64_t leaf_depth_ = -1;     // nesting depth of the numbers
  std::vector<int64_t> dims_;   // entries per array, by depth
};

void Format(const std::vector<int64_t>& shape, const std::vector<float>& values, size_t depth,
            size_t* next, std::string* out) {
  if (depth == shape.size()) {
    absl::StrAppend(out, absl::StrFormat("%.9g", values[(*next)++]));
    return;
  }
  out->push_back('[');
  for (int64_t i = 0; i < shape[depth]; ++i) {
    if (i) out->append(", ");
    Format(shape, values, depth + 1, next, out);
  }
  out->push_back(']');
}

}  // namespace

absl::StatusOr<JsonArray> ParseJsonArray(absl::string_view text) {
  JsonArray out;
  Parser parser(text);
  absl::Status status = parser.Parse(&out);
  if (!status.ok()) return status;
  return out;
}

std::string FormatJsonArray(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  std::string out;
  size_t next = 0;
  Format(shape, values, 0, &next, &out);
  return out;
}

}  // namespace shardserve::client
