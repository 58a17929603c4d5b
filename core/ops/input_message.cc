#include "core/ops/input_message.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/ops/op_inputs.h"

namespace shardserve::core {
namespace {

constexpr int64_t kHasWeights = 1;

int64_t Packed(int64_t floats) { return (floats + 1) / 2; }  // words holding `floats` floats

}  // namespace

InputLayout InputLayout::Of(InputKind kind, int64_t num, int64_t num_bags, bool has_weights) {
  InputLayout l;
  l.ids = kHeaderWords;
  if (kind == InputKind::kRows) {
    l.floats = kHeaderWords;
    l.words = kHeaderWords + Packed(num);
    return l;
  }
  l.offsets = l.ids + num;
  l.floats = l.offsets + (kind == InputKind::kBags ? num_bags + 1 : 0);
  l.words = l.floats + (kind == InputKind::kBags && has_weights ? Packed(num) : 0);
  return l;
}

InputLayout AppendInputMessage(InputKind kind, int64_t num, int64_t num_bags, bool has_weights,
                               PoolMode mode, std::vector<int64_t>& out) {
  const bool bagged = kind == InputKind::kBags;
  InputLayout layout = InputLayout::Of(kind, num, num_bags, has_weights);
  const size_t at = out.size();
  out.resize(at + layout.words);
  out[at] = num;
  out[at + 1] = bagged ? num_bags : -1;
  out[at + 2] = (bagged && has_weights ? kHasWeights : 0) | (static_cast<int64_t>(mode) << 1);
  return layout;
}

std::vector<int64_t> EncodeInput(const EmbeddingInput& input) {
  std::vector<int64_t> out;
  const int64_t n = static_cast<int64_t>(input.ids.size());
  const InputLayout l = AppendInputMessage(InputKind::kIds, n, 0, false, PoolMode::kSum, out);
  std::copy(input.ids.begin(), input.ids.end(), out.begin() + l.ids);
  return out;
}

std::vector<int64_t> EncodeInput(const EmbeddingBagInput& input, const CanonicalBags& bags) {
  std::vector<int64_t> out;
  const int64_t n = static_cast<int64_t>(input.ids.size());
  const bool weighted = input.per_sample_weights.has_value();
  const InputLayout l =
      AppendInputMessage(InputKind::kBags, n, bags.num_bags(), weighted, input.mode, out);
  std::copy(input.ids.begin(), input.ids.end(), out.begin() + l.ids);
  std::copy(bags.offsets.begin(), bags.offsets.end(), out.begin() + l.offsets);
  if (weighted) std::memcpy(out.data() + l.floats, input.per_sample_weights->data(), n * 4);
  return out;
}

std::vector<int64_t> EncodeInput(const LinearInput& input) {
  std::vector<int64_t> out;
  const int64_t n = static_cast<int64_t>(input.values.size());
  const InputLayout l = AppendInputMessage(InputKind::kRows, n, 0, false, PoolMode::kSum, out);
  if (n > 0) std::memcpy(out.data() + l.floats, input.values.data(), n * sizeof(float));
  return out;
}

std::vector<int64_t> EmptyInput(InputKind kind, PoolMode mode) {
  std::vector<int64_t> out;
  const InputLayout l = AppendInputMessage(kind, 0, 0, false, mode, out);
  if (kind == InputKind::kBags) out[l.offsets] = 0;
  return out;
}

std::vector<int64_t> GatheredInputs::NumIds() const {
  std::vector<int64_t> n;
  for (const InputSource& s : sources) n.push_back(s.num_ids);
  return n;
}

std::vector<int64_t> GatheredInputs::NumBags() const {
  std::vector<int64_t> n;
  for (const InputSource& s : sources) n.push_back(s.num_bags);
  return n;
}

absl::StatusOr<GatheredInputs> DecodeInputs(InputKind kind, const TableConfig& table,
                                            absl::Span<const absl::Span<const char>> messages) {
  GatheredInputs g;
  g.sources.resize(messages.size());
  for (size_t q = 0; q < messages.size(); ++q) {
    auto bad = [q](absl::string_view what) {
      return absl::InternalError(absl::StrCat("the input message of rank ", q, " ", what));
    };
    const absl::Span<const char> m = messages[q];
    const auto* words = reinterpret_cast<const int64_t*>(m.data());
    const int64_t available = static_cast<int64_t>(m.size() / sizeof(int64_t));
    if (available < InputLayout::kHeaderWords ||
        reinterpret_cast<uintptr_t>(words) % sizeof(int64_t) != 0) {
      return bad("is too short or not aligned");
    }
    const int64_t num = words[0], num_bags = words[1], flags = words[2];
    const bool bagged = kind == InputKind::kBags;
    const bool weighted = (flags & kHasWeights) != 0;
    const int64_t mode = flags >> 1;
    if (num < 0 || num > (int64_t{1} << 40) || (bagged ? num_bags < 0 : num_bags != -1) ||
        num_bags > (int64_t{1} << 40) || mode < 0 || mode > 2 || (weighted && !bagged)) {
      return bad("has a header that does not hold what its op sends");
    }
    const InputLayout l = InputLayout::Of(kind, num, num_bags, weighted);
    if (l.words != available) return bad("does not hold what its header says");
    InputSource& s = g.sources[q];
    s.mode = static_cast<PoolMode>(mode);
    if (kind == InputKind::kRows) {
      if (table.num_cols == 0 ? num != 0 : num % table.num_cols != 0) {
        return bad("holds no whole rows of the layer's inputs");
      }
      s.num_ids = table.num_cols == 0 ? 0 : num / table.num_cols;
      s.rows = reinterpret_cast<const float*>(words + l.floats);
      continue;
    }
    s.num_ids = num;
    s.ids = words + l.ids;
    if (!IdsInRange(absl::MakeConstSpan(s.ids, num), table.num_rows)) {
      return bad("holds ids outside the table");
    }
    if (!bagged) continue;
    s.num_bags = num_bags;
    s.offsets = words + l.offsets;
    if (s.offsets[0] != 0 || s.offsets[num_bags] != num ||
        !std::is_sorted(s.offsets, s.offsets + num_bags + 1)) {
      return bad("holds bag offsets that are not canonical");
    }
    if (weighted) s.weights = reinterpret_cast<const float*>(words + l.floats);
  }
  return g;
}

}  // namespace shardserve::core
