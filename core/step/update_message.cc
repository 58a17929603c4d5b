#include "core/step/update_message.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace shardserve::core {
namespace {

constexpr int64_t kCallHeaderWords = 4;  // kind, k, has_bias, expected sequence
int64_t Packed(int64_t floats) { return (floats + 1) / 2; }

// Appends `n` floats to `out` as words, two to a word (the last one padded with zero).
void AppendFloats(const float* floats, int64_t n, std::vector<int64_t>& out) {
  const auto* words = reinterpret_cast<const char*>(floats);
  const size_t at = out.size();
  out.resize(at + Packed(n));  // (value-initialised; the copy below overwrites it)
  std::memcpy(out.data() + at, words, n * sizeof(float));
  if (n % 2 != 0) std::memset(reinterpret_cast<char*>(out.data() + at) + n * 4, 0, 4);
}

}  // namespace

void AppendUpdateMessage(absl::Span<StepRequest* const> requests, std::vector<int64_t>& out) {
  size_t words = 1;
  for (const StepRequest* r : requests) {
    const int64_t k = static_cast<int64_t>(r->ids.size());
    words += kCallHeaderWords + k + Packed(static_cast<int64_t>(r->values.size())) +
             (r->bias.empty() ? 0 : Packed(k));
  }
  out.reserve(out.size() + words);
  out.push_back(static_cast<int64_t>(requests.size()));
  for (const StepRequest* r : requests) {
    const int64_t k = static_cast<int64_t>(r->ids.size());
    out.push_back(static_cast<int64_t>(r->update));
    out.push_back(k);
    out.push_back(r->bias.empty() ? 0 : 1);
    out.push_back(static_cast<int64_t>(r->expected_seq));
    out.insert(out.end(), r->ids.begin(), r->ids.end());
    AppendFloats(r->values.data(), static_cast<int64_t>(r->values.size()), out);
    if (!r->bias.empty()) AppendFloats(r->bias.data(), k, out);
  }
}

std::vector<int64_t> EmptyUpdateMessage() { return {0}; }

absl::StatusOr<std::vector<std::vector<UpdateCall>>> DecodeUpdates(
    const TableConfig& table, absl::Span<const absl::Span<const char>> messages) {
  std::vector<std::vector<UpdateCall>> out(messages.size());
  for (size_t q = 0; q < messages.size(); ++q) {
    const auto* w = reinterpret_cast<const int64_t*>(messages[q].data());
    const int64_t n = static_cast<int64_t>(messages[q].size() / sizeof(int64_t));
    auto bad = [&](absl::string_view what) {
      return absl::InternalError(absl::StrCat("step: the update message of rank ", q, " ", what));
    };
    if (n < 1 || w[0] < 0 || w[0] > n) return bad("has no valid call count");
    int64_t at = 1;
    for (int64_t c = 0; c < w[0]; ++c) {
      if (n - at < kCallHeaderWords) return bad("ends in a call's header");
      UpdateCall call;
      call.kind = static_cast<UpdateKind>(w[at]);
      call.k = w[at + 1];
      const bool has_bias = w[at + 2] != 0;
      call.expected_seq = static_cast<uint64_t>(w[at + 3]);
      if ((call.kind != UpdateKind::kAssign && call.kind != UpdateKind::kAdd) || call.k < 0 ||
          call.k > n) {
        return bad("holds a call that is not an update");
      }
      const int64_t words =
          call.k + Packed(call.k * table.num_cols) + (has_bias ? Packed(call.k) : 0);
      if (n - at - kCallHeaderWords < words) return bad("ends in a call's data");
      if (has_bias && (table.kind != TableKind::kLinear || !table.has_bias)) {
        return bad("updates a bias the table does not have");
      }
      call.ids = w + at + kCallHeaderWords;
      for (int64_t i = 0; i < call.k; ++i) {
        if (call.ids[i] < 0 || call.ids[i] >= table.num_rows) return bad("names a row outside");
      }
      call.values = reinterpret_cast<const float*>(call.ids + call.k);
      if (has_bias) {
        call.bias = reinterpret_cast<const float*>(call.ids + call.k +
                                                   Packed(call.k * table.num_cols));
      }
      at += kCallHeaderWords + words;
      out[q].push_back(call);
    }
    if (at != n) return bad("has words after its calls");
  }
  return out;
}

}  // namespace shardserve::core
