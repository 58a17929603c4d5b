#include "core/sharded_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace shardserve::core {
namespace {

constexpr int64_t kHeaderSize = 4;  // valid, ids, bags (-1: no offsets), flags
constexpr int64_t kHasWeights = 1;

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

std::vector<int64_t> Scaled(const std::vector<int64_t>& v, int64_t factor) {
  std::vector<int64_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * factor;
  return out;
}

// Bags of one source re-expressed over local shard rows, keeping only the ids `local_row` maps to
// a row (>= 0): ids of other shards and padding ids drop out of the bag.
struct LocalBags {
  std::vector<int64_t> ids;
  std::vector<int64_t> offsets;
  std::vector<float> weights;
};

template <typename LocalRow>
LocalBags FilterBags(const int64_t* ids, const int64_t* offsets, const float* weights,
                     int64_t num_bags, LocalRow&& local_row) {
  LocalBags out;
  out.offsets.reserve(num_bags + 1);
  out.offsets.push_back(0);
  out.ids.reserve(offsets[num_bags]);
  if (weights != nullptr) out.weights.reserve(offsets[num_bags]);
  for (int64_t b = 0; b < num_bags; ++b) {
    for (int64_t j = offsets[b]; j < offsets[b + 1]; ++j) {
      const int64_t row = local_row(ids[j]);
      if (row < 0) continue;
      out.ids.push_back(row);
      if (weights != nullptr) out.weights.push_back(weights[j]);
    }
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
  }
  return out;
}

}  // namespace

// Every rank's ids (and bags) after the input all-gather, identical on all ranks.
struct ShardedOps::Gathered {
  std::vector<bool> valid;
  std::vector<int64_t> num_ids;
  std::vector<int64_t> num_bags;
  std::vector<PoolMode> mode;
  std::vector<int64_t> payload;  // per source: ids, then offsets (bags + 1), then packed weights
  std::vector<int64_t> begin;    // index of each source's block in payload
  std::vector<int64_t> bag_begin;  // index of each source's first bag among all bags
  std::vector<bool> has_weights;

  int world() const { return static_cast<int>(valid.size()); }
  const int64_t* ids(int s) const { return payload.data() + begin[s]; }
  const int64_t* offsets(int s) const { return ids(s) + num_ids[s]; }
  const float* weights(int s) const {
    return has_weights[s] ? reinterpret_cast<const float*>(offsets(s) + num_bags[s] + 1) : nullptr;
  }
};

absl::StatusOr<ShardedOps::Gathered> ShardedOps::GatherIds(bool valid,
                                                           absl::Span<const int64_t> ids,
                                                           const std::vector<int64_t>* offsets,
                                                           const float* weights, PoolMode mode) {
  const int world = control_.world_size();
  const bool bagged = offsets != nullptr;
  int64_t header[kHeaderSize] = {
      valid ? 1 : 0, valid ? static_cast<int64_t>(ids.size()) : 0,
      bagged ? (valid ? static_cast<int64_t>(offsets->size()) - 1 : 0) : -1,
      ((valid && weights != nullptr) ? kHasWeights : 0) | (static_cast<int64_t>(mode) << 1)};
  std::vector<int64_t> headers(world * kHeaderSize);
  RETURN_IF_ERROR(control_.AllGatherV(header, headers.data(),
                                      std::vector<int64_t>(world, kHeaderSize),
                                      options_.collective_timeout));
  Gathered g;
  g.valid.resize(world);
  g.num_ids.resize(world);
  g.num_bags.resize(world);
  g.mode.resize(world);
  g.has_weights.resize(world);
  g.begin.resize(world);
  g.bag_begin.resize(world);
  std::vector<int64_t> counts(world);
  int64_t total = 0, bags_total = 0;
  for (int s = 0; s < world; ++s) {
    const int64_t* h = &headers[s * kHeaderSize];
    g.valid[s] = h[0] == 1;
    g.num_ids[s] = h[1];
    g.num_bags[s] = std::max<int64_t>(h[2], 0);
    g.has_weights[s] = (h[3] & kHasWeights) != 0;
    g.mode[s] = static_cast<PoolMode>(h[3] >> 1);
    counts[s] = g.num_ids[s] + (bagged ? g.num_bags[s] + 1 : 0) +
                (g.has_weights[s] ? (g.num_ids[s] + 1) / 2 : 0);
    g.begin[s] = total;
    g.bag_begin[s] = bags_total;
    total += counts[s];
    bags_total += g.num_bags[s];
  }
  // An invalid source sends no ids and, when bagged, the offsets {0} of zero bags.
  const int me = control_.rank();
  std::vector<int64_t> mine(counts[me], 0);
  if (valid) {
    std::copy(ids.begin(), ids.end(), mine.begin());
    if (bagged) std::copy(offsets->begin(), offsets->end(), mine.begin() + ids.size());
    if (weights != nullptr) {
      std::memcpy(mine.data() + ids.size() + offsets->size(), weights, ids.size() * sizeof(float));
    }
  }
  g.payload.resize(total);
  RETURN_IF_ERROR(control_.AllGatherV(mine.data(), g.payload.data(), counts,
                                      options_.collective_timeout));
  return g;
}

absl::Status ShardedOps::RenormLookedUpRows(ShardedTable& table, const Gathered& g) {
  const TableConfig& config = table.config();
  if (!config.max_norm.has_value()) return absl::OkStatus();
  std::vector<int64_t> unique;
  for (int s = 0; s < g.world(); ++s) {
    if (g.valid[s]) unique.insert(unique.end(), g.ids(s), g.ids(s) + g.num_ids[s]);
  }
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  if (unique.empty()) return absl::OkStatus();  // identical on every rank

  const bool column_split = config.spec.dim() == 1;
  std::vector<int64_t> local;  // shard rows of the looked-up ids this rank holds
  if (column_split) {
    local = std::move(unique);
  } else {
    for (int64_t id : unique) {
      if (id >= table.row_begin() && id < table.row_begin() + table.shard().rows) {
        local.push_back(id - table.row_begin());
      }
    }
  }
  const int64_t n = static_cast<int64_t>(local.size());
  std::vector<double> power_sums(n);
  const double p = config.norm_type;
  RETURN_IF_ERROR(kernels_.RowPowerSums(table.shard(), local.data(), n, p, power_sums.data()));
  if (column_split) {  // each rank holds some columns of every row: sum the partial powers
    RETURN_IF_ERROR(control_.AllReduce(power_sums.data(), n, ReduceOp::kSum,
                                       options_.collective_timeout));
  }
  std::vector<int64_t> rows;
  std::vector<float> scales;
  const double max_norm = *config.max_norm;
  for (int64_t i = 0; i < n; ++i) {
    const double norm = p == 1.0 ? power_sums[i]
                        : p == 2.0 ? std::sqrt(power_sums[i])
                                   : std::pow(power_sums[i], 1.0 / p);
    if (norm > max_norm) {  // embedding_renorm_'s rule
      rows.push_back(local[i]);
      scales.push_back(static_cast<float>(max_norm / (norm + 1e-7)));
    }
  }
  return kernels_.ScaleRows(table.shard(), rows.data(), static_cast<int64_t>(rows.size()),
                            scales.data());
}

absl::StatusOr<std::vector<float>> ShardedOps::ToHost(const DeviceBuffer& buffer, int64_t floats) {
  std::vector<float> host(floats);
  RETURN_IF_ERROR(kernels_.CopyToHost(buffer.data(), host.data(), floats * sizeof(float)));
  return host;
}

absl::StatusOr<std::vector<float>> ShardedOps::ExchangeColumnBlocks(
    const ShardLayout& layout, const std::vector<int64_t>& rows_of, const DeviceBuffer& local) {
  const int world = data_.world_size();
  const int me = data_.rank();
  std::vector<int64_t> send(world), recv(world);
  for (int q = 0; q < world; ++q) {
    send[q] = rows_of[q] * layout.SizeOfRank(me);
    recv[q] = rows_of[me] * layout.SizeOfRank(q);
  }
  ASSIGN_OR_RETURN(DeviceBuffer received, kernels_.Allocate(Sum(recv) * sizeof(float)));
  RETURN_IF_ERROR(data_.AllToAllV(local.floats(), send, received.floats(), recv,
                                  options_.collective_timeout));
  std::vector<float> staged;
  const float* blocks = received.floats();
  if (!kernels_.host_accessible()) {
    ASSIGN_OR_RETURN(staged, ToHost(received, Sum(recv)));
    blocks = staged.data();
  }
  // Block q holds rows_of[me] rows of rank q's columns; place them at q's column offset.
  const int64_t rows = rows_of[me];
  const int64_t width = layout.n();
  std::vector<float> out(rows * width);
  for (int q = 0; q < world; ++q) {
    const int64_t cols = layout.SizeOfRank(q);
    const int64_t col0 = layout.OffsetOfRank(q);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(&out[r * width + col0], blocks + r * cols, cols * sizeof(float));
    }
    blocks += rows * cols;
  }
  return out;
}

absl::StatusOr<DenseResult> ShardedOps::Embedding(ShardedTable& table,
                                                  const EmbeddingInput& input) {
  const TableConfig& config = table.config();
  const absl::Status validation = ValidateEmbeddingInput(config, input, options_.limits);
  const bool valid = validation.ok();
  ASSIGN_OR_RETURN(Gathered g, GatherIds(valid, valid ? input.ids : absl::Span<const int64_t>(),
                                         nullptr, nullptr, PoolMode::kSum));
  RETURN_IF_ERROR(RenormLookedUpRows(table, g));

  const int me = data_.rank();
  const int world = data_.world_size();
  const int64_t dim = config.num_cols;
  DenseResult result;
  if (config.spec.dim() == 1) {
    // Every rank holds a column chunk of every row: look up all ranks' ids, swap column blocks.
    const int64_t all = Sum(g.num_ids);
    const int64_t cols = table.shard().cols;
    ASSIGN_OR_RETURN(DeviceBuffer local, kernels_.Allocate(all * cols * sizeof(float)));
    RETURN_IF_ERROR(kernels_.GatherRows(table.shard(), g.payload.data(), all, local.floats()));
    ASSIGN_OR_RETURN(result.values, ExchangeColumnBlocks(table.layout(), g.num_ids, local));
  } else {
    // Row chunks: each rank sends every source exactly the rows it owns of that source's ids.
    const ShardLayout& layout = table.layout();
    std::vector<int64_t> send(world, 0), recv(world, 0), local_rows;
    for (int s = 0; s < world; ++s) {
      for (int64_t i = 0; i < g.num_ids[s]; ++i) {
        const int64_t id = g.ids(s)[i];
        if (layout.OwnerOf(id) == me) {
          local_rows.push_back(id - table.row_begin());
          ++send[s];
        }
        if (s == me) ++recv[layout.OwnerOf(id)];
      }
    }
    const int64_t n = static_cast<int64_t>(local_rows.size());
    ASSIGN_OR_RETURN(DeviceBuffer rows, kernels_.Allocate(n * dim * sizeof(float)));
    RETURN_IF_ERROR(kernels_.GatherRows(table.shard(), local_rows.data(), n, rows.floats()));
    ASSIGN_OR_RETURN(DeviceBuffer received, kernels_.Allocate(Sum(recv) * dim * sizeof(float)));
    RETURN_IF_ERROR(data_.AllToAllV(rows.floats(), Scaled(send, dim), received.floats(),
                                    Scaled(recv, dim), options_.collective_timeout));
    std::vector<float> staged;
    const float* blocks = received.floats();
    if (!kernels_.host_accessible()) {
      ASSIGN_OR_RETURN(staged, ToHost(received, Sum(recv) * dim));
      blocks = staged.data();
    }
    std::vector<int64_t> cursor(world, 0);  // next row of each owner's block
    for (int q = 1; q < world; ++q) cursor[q] = cursor[q - 1] + recv[q - 1];
    result.values.resize(g.num_ids[me] * dim);
    for (int64_t i = 0; i < g.num_ids[me]; ++i) {
      const int owner = layout.OwnerOf(g.ids(me)[i]);
      std::memcpy(&result.values[i * dim], blocks + cursor[owner]++ * dim, dim * sizeof(float));
    }
  }
  if (!valid) return validation;
  result.shape = input.shape;
  result.shape.push_back(dim);
  return result;
}

absl::StatusOr<DenseResult> ShardedOps::EmbeddingBag(ShardedTable& table,
                                                     const EmbeddingBagInput& input) {
  const TableConfig& config = table.config();
  absl::StatusOr<CanonicalBags> bags = ValidateEmbeddingBagInput(config, input, options_.limits);
  const bool valid = bags.ok();
  const float* weights =
      valid && input.per_sample_weights.has_value() ? input.per_sample_weights->data() : nullptr;
  ASSIGN_OR_RETURN(Gathered g,
                   GatherIds(valid, valid ? input.ids : absl::Span<const int64_t>(),
                             valid ? &bags->offsets : nullptr, weights, input.mode));
  RETURN_IF_ERROR(RenormLookedUpRows(table, g));

  const int me = data_.rank();
  const int world = data_.world_size();
  const int64_t dim = config.num_cols;
  const int64_t all_bags = Sum(g.num_bags);
  const std::optional<int64_t> padding = config.padding_idx;
  const MatrixView shard = table.shard();
  DenseResult result;
  if (config.spec.dim() == 1) {
    // Column chunks: pool every source's bags over this rank's columns, then swap column blocks.
    ASSIGN_OR_RETURN(DeviceBuffer local, kernels_.Allocate(all_bags * shard.cols * sizeof(float)));
    for (int s = 0; s < world; ++s) {
      if (g.num_bags[s] == 0) continue;
      float* out = local.floats() + g.bag_begin[s] * shard.cols;
      if (!padding.has_value()) {
        const BagsView view{g.ids(s), g.offsets(s), g.weights(s), g.num_bags[s]};
        RETURN_IF_ERROR(kernels_.PoolBags(shard, view, g.mode[s], 0.0f, out));
        continue;
      }
      const int64_t pad = *padding;
      LocalBags filtered = FilterBags(g.ids(s), g.offsets(s), g.weights(s), g.num_bags[s],
                                      [pad](int64_t id) { return id == pad ? -1 : id; });
      const BagsView view{filtered.ids.data(), filtered.offsets.data(),
                          g.weights(s) ? filtered.weights.data() : nullptr, g.num_bags[s]};
      RETURN_IF_ERROR(kernels_.PoolBags(shard, view, g.mode[s], 0.0f, out));
    }
    ASSIGN_OR_RETURN(result.values, ExchangeColumnBlocks(table.layout(), g.num_bags, local));
  } else {
    // Row chunks: pool each source's bags over the ids this rank owns (sum for sum/mean, max with
    // -inf for bags with none), send each source its partials, and reduce what comes back.
    const int64_t begin = table.row_begin(), end = begin + shard.rows;
    const int64_t pad = padding.value_or(-1);
    auto local_row = [begin, end, pad](int64_t id) {
      return (id >= begin && id < end && id != pad) ? id - begin : -1;
    };
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    ASSIGN_OR_RETURN(DeviceBuffer partial, kernels_.Allocate(all_bags * dim * sizeof(float)));
    for (int s = 0; s < world; ++s) {
      if (g.num_bags[s] == 0) continue;
      LocalBags filtered =
          FilterBags(g.ids(s), g.offsets(s), g.weights(s), g.num_bags[s], local_row);
      const BagsView view{filtered.ids.data(), filtered.offsets.data(),
                          g.weights(s) ? filtered.weights.data() : nullptr, g.num_bags[s]};
      const PoolMode mode = g.mode[s] == PoolMode::kMax ? PoolMode::kMax : PoolMode::kSum;
      RETURN_IF_ERROR(kernels_.PoolBags(shard, view, mode, kNegInf,
                                        partial.floats() + g.bag_begin[s] * dim));
    }
    const int64_t mine = g.num_bags[me] * dim;
    ASSIGN_OR_RETURN(DeviceBuffer received, kernels_.Allocate(world * mine * sizeof(float)));
    RETURN_IF_ERROR(data_.AllToAllV(partial.floats(), Scaled(g.num_bags, dim), received.floats(),
                                    std::vector<int64_t>(world, mine),
                                    options_.collective_timeout));
    std::vector<float> staged;
    const float* blocks = received.floats();
    if (!kernels_.host_accessible()) {
      ASSIGN_OR_RETURN(staged, ToHost(received, world * mine));
      blocks = staged.data();
    }
    result.values.assign(blocks, blocks + mine);
    const bool max_mode = g.mode[me] == PoolMode::kMax;
    for (int q = 1; q < world; ++q) {
      const float* block = blocks + q * mine;
      if (max_mode) {
        for (int64_t i = 0; i < mine; ++i) result.values[i] = std::max(result.values[i], block[i]);
      } else {
        for (int64_t i = 0; i < mine; ++i) result.values[i] += block[i];
      }
    }
    if (valid && g.mode[me] != PoolMode::kSum) {
      // Count the ids that took part in each bag (padding excluded) to finish mean and max.
      for (int64_t b = 0; b < g.num_bags[me]; ++b) {
        int64_t count = 0;
        for (int64_t j = g.offsets(me)[b]; j < g.offsets(me)[b + 1]; ++j) {
          count += g.ids(me)[j] != pad ? 1 : 0;
        }
        float* row = &result.values[b * dim];
        if (max_mode && count == 0) {
          std::fill(row, row + dim, 0.0f);  // empty bag: every rank sent -inf
        } else if (!max_mode && count > 0) {
          for (int64_t j = 0; j < dim; ++j) row[j] /= static_cast<float>(count);
        }
      }
    }
  }
  if (!valid) return bags.status();
  result.shape = {g.num_bags[me], dim};
  return result;
}

absl::StatusOr<DenseResult> ShardedOps::Linear(ShardedTable& table, const LinearInput& input) {
  const TableConfig& config = table.config();
  absl::StatusOr<int64_t> rows = ValidateLinearInput(config, input, options_.limits);
  const bool valid = rows.ok();
  const int world = control_.world_size();
  const int me = control_.rank();
  const int64_t in = config.num_cols, out_features = config.num_rows;

  // All-gather the inputs: row counts first, then the rows.
  int64_t my_rows = valid ? *rows : 0;
  std::vector<int64_t> rows_of(world);
  RETURN_IF_ERROR(control_.AllGatherV(&my_rows, rows_of.data(), std::vector<int64_t>(world, 1),
                                      options_.collective_timeout));
  const int64_t all_rows = Sum(rows_of);
  std::vector<float> x(all_rows * in);
  RETURN_IF_ERROR(control_.AllGatherV(valid ? input.values.data() : nullptr, x.data(),
                                      Scaled(rows_of, in), options_.collective_timeout));

  const MatrixView shard = table.shard();
  const float* bias = table.bias().empty() ? nullptr : table.bias().data();
  DenseResult result;
  if (config.spec.dim() == 0) {
    // Output features are split: this rank computes its output columns for every source's rows.
    ASSIGN_OR_RETURN(DeviceBuffer local, kernels_.Allocate(all_rows * shard.rows * sizeof(float)));
    RETURN_IF_ERROR(kernels_.Linear(x.data(), all_rows, in, 0, shard,
                                    bias ? bias + table.row_begin() : nullptr, local.floats()));
    ASSIGN_OR_RETURN(result.values, ExchangeColumnBlocks(table.layout(), rows_of, local));
  } else {
    // Input features are split: partial products over this rank's inputs, summed across ranks.
    ASSIGN_OR_RETURN(DeviceBuffer partial,
                     kernels_.Allocate(all_rows * out_features * sizeof(float)));
    RETURN_IF_ERROR(kernels_.Linear(x.data(), all_rows, in, table.col_begin(), shard, nullptr,
                                    partial.floats()));
    const int64_t mine = rows_of[me] * out_features;
    ASSIGN_OR_RETURN(DeviceBuffer reduced, kernels_.Allocate(mine * sizeof(float)));
    RETURN_IF_ERROR(data_.ReduceScatter(partial.floats(), Scaled(rows_of, out_features),
                                        reduced.floats(), ReduceOp::kSum,
                                        options_.collective_timeout));
    ASSIGN_OR_RETURN(result.values, ToHost(reduced, mine));
    if (bias != nullptr) {  // added once, after the partial sums
      for (int64_t r = 0; r < rows_of[me]; ++r) {
        for (int64_t j = 0; j < out_features; ++j) result.values[r * out_features + j] += bias[j];
      }
    }
  }
  if (!valid) return rows.status();
  result.shape.assign(input.shape.begin(), input.shape.end() - 1);
  result.shape.push_back(out_features);
  return result;
}

}  // namespace shardserve::core
