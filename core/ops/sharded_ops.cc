#include "core/ops/sharded_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/table/update_log.h"

namespace shardserve::core {
namespace {

int64_t Sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

std::vector<int64_t> Scaled(const std::vector<int64_t>& v, int64_t factor) {
  std::vector<int64_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * factor;
  return out;
}

// Sums the W blocks of `size` floats that arrived from every rank.
FloatBuffer ReduceBlocks(const std::vector<const float*>& blocks, int64_t size) {
  FloatBuffer out(blocks[0], blocks[0] + size);
  for (size_t q = 1; q < blocks.size(); ++q) {
    const float* block = blocks[q];
    for (int64_t i = 0; i < size; ++i) out[i] += block[i];
  }
  return out;
}

// Row-split max-mode bags of one source, reduced from every rank's partial to what ATen's max over
// the whole bag gives (LocalKernels::PoolBags): the first row's element where that is NaN, else the
// greatest element, the first of equal ones (-0.0, +0.0) in the bag's order; 0 for a bag with no
// ids but padding. blocks[q] holds rank q's partial: num_bags x dim values, then as many int32
// indices into q's part of each bag (its own ids there, in order) of the row each value came from
// (-1: none). The rank with a bag's first row pooled it from that row (its value is that row's NaN,
// if it is one), the others from -inf (theirs are never NaN).
absl::StatusOr<FloatBuffer> ReduceMaxBags(const std::vector<const float*>& blocks,
                                          const int64_t* ids, const int64_t* offsets,
                                          int64_t num_bags, int64_t dim, const ShardLayout& layout,
                                          int64_t pad) {
  const int64_t size = num_bags * dim;
  FloatBuffer out(size, 0.0f);
  std::vector<std::vector<int64_t>> positions(blocks.size());  // of each rank's ids in the bag
  for (int64_t b = 0; b < num_bags; ++b) {
    for (std::vector<int64_t>& p : positions) p.clear();
    int first = -1;
    for (int64_t j = offsets[b]; j < offsets[b + 1]; ++j) {
      if (ids[j] == pad) continue;
      const int owner = layout.OwnerOf(ids[j]);
      if (first < 0) first = owner;
      positions[owner].push_back(j);
    }
    if (first < 0) continue;
    // Where in the bag the row of rank q's value at i lies (-1: q has none above -inf).
    auto position = [&](int q, int64_t i) -> absl::StatusOr<int64_t> {
      int32_t k;
      std::memcpy(&k, blocks[q] + size + i, sizeof(k));
      if (k < 0) return -1;
      if (k >= static_cast<int64_t>(positions[q].size())) {
        return absl::InternalError(absl::StrCat("rank ", q, "'s max of bag ", b, " names row ", k,
                                                " of its ", positions[q].size()));
      }
      return positions[q][k];
    };
    for (int64_t i = b * dim; i < (b + 1) * dim; ++i) {
      float best = blocks[first][i];
      SHARDSERVE_ASSIGN_OR_RETURN(int64_t best_at, position(first, i));
      for (int q = 0; q < static_cast<int>(blocks.size()) && !std::isnan(best); ++q) {
        if (q == first) continue;
        SHARDSERVE_ASSIGN_OR_RETURN(const int64_t at, position(q, i));
        if (at < 0) continue;
        const float v = blocks[q][i];
        if (v > best || (v == best && at < best_at)) {
          best = v;
          best_at = at;
        }
      }
      out[i] = best;
    }
  }
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

absl::StatusOr<GatheredInputs> ShardedOps::Gather(InputKind kind, const TableConfig& config,
                                                  const std::vector<int64_t>& mine) {
  if (inputs_ == nullptr) {
    return absl::FailedPreconditionError("ShardedOps: no input channel to gather inputs over");
  }
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::vector<absl::Span<const char>> messages,
      inputs_->AllGatherMessages(
          absl::Span<const char>(reinterpret_cast<const char*>(mine.data()), mine.size() * 8),
          options_.collective_timeout));
  return DecodeInputs(kind, config, messages);
}

absl::StatusOr<DenseResult> ShardedOps::Embedding(ShardedTable& table,
                                                  const EmbeddingInput& input) {
  const TableConfig& config = table.config();
  const absl::Status valid = ValidateEmbeddingInput(config, input, options_.limits);
  SHARDSERVE_ASSIGN_OR_RETURN(
      GatheredInputs g, Gather(InputKind::kIds, config,
                               valid.ok() ? EncodeInput(input) : EmptyInput(InputKind::kIds)));
  SHARDSERVE_ASSIGN_OR_RETURN(DenseResult result, Embedding(table, g));
  if (!valid.ok()) return valid;
  result.shape = input.shape;
  result.shape.push_back(config.num_cols);
  return result;
}

absl::StatusOr<DenseResult> ShardedOps::EmbeddingBag(ShardedTable& table,
                                                     const EmbeddingBagInput& input) {
  const TableConfig& config = table.config();
  absl::StatusOr<CanonicalBags> bags = ValidateEmbeddingBagInput(config, input, options_.limits);
  SHARDSERVE_ASSIGN_OR_RETURN(
      GatheredInputs g,
      Gather(InputKind::kBags, config,
             bags.ok() ? EncodeInput(input, *bags) : EmptyInput(InputKind::kBags, input.mode)));
  SHARDSERVE_ASSIGN_OR_RETURN(DenseResult result, EmbeddingBag(table, g));
  if (!bags.ok()) return bags.status();
  return result;
}

absl::StatusOr<DenseResult> ShardedOps::Linear(ShardedTable& table, const LinearInput& input) {
  const TableConfig& config = table.config();
  const absl::Status valid = ValidateLinearInput(config, input, options_.limits).status();
  SHARDSERVE_ASSIGN_OR_RETURN(
      GatheredInputs g, Gather(InputKind::kRows, config,
                               valid.ok() ? EncodeInput(input) : EmptyInput(InputKind::kRows)));
  SHARDSERVE_ASSIGN_OR_RETURN(DenseResult result, Linear(table, g));
  if (!valid.ok()) return valid;
  result.shape.assign(input.shape.begin(), input.shape.end() - 1);
  result.shape.push_back(config.num_rows);
  return result;
}

absl::Status ShardedOps::RenormLookedUpRows(ShardedTable& table, const GatheredInputs& g) {
  const TableConfig& config = table.config();
  if (!config.max_norm.has_value()) return absl::OkStatus();
  std::vector<int64_t> unique;
  for (const InputSource& s : g.sources) unique.insert(unique.end(), s.ids, s.ids + s.num_ids);
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
  SHARDSERVE_RETURN_IF_ERROR(
      kernels_.RowPowerSums(table.shard(), local.data(), n, p, power_sums.data()));
  const bool max_abs = std::isinf(p);
  if (column_split && max_abs) {
    // Each rank holds some columns of every row: the max-abs norm is the max of the partial ones,
    // and a NaN must win (torch's norm of a row with a NaN is NaN) whatever the all-reduce's max
    // does with NaN: NaN travels as +inf, and +inf as the largest double (partials are floats).
    constexpr double kInf = std::numeric_limits<double>::infinity();
    constexpr double kMax = std::numeric_limits<double>::max();
    for (double& v : power_sums) v = std::isnan(v) ? kInf : v == kInf ? kMax : v;
    SHARDSERVE_RETURN_IF_ERROR(
        control_.AllReduce(power_sums.data(), n, ReduceOp::kMax, options_.collective_timeout));
    for (double& v : power_sums) v = v == kInf ? std::nan("") : v == kMax ? kInf : v;
  } else if (column_split) {  // sum the partial powers
    SHARDSERVE_RETURN_IF_ERROR(
        control_.AllReduce(power_sums.data(), n, ReduceOp::kSum, options_.collective_timeout));
  }
  std::vector<int64_t> rows;
  std::vector<float> scales;
  const double max_norm = *config.max_norm;
  for (int64_t i = 0; i < n; ++i) {
    // The norm in float, as embedding_renorm_ takes it from torch's float norm: where torch's
    // overflows to inf the row is scaled by 0 (its infinities become NaN), where its terms
    // underflow to 0 the row is left alone, and so does a NaN norm (NaN > max_norm is false).
    // The float sum of partial powers is the sum of the ranks' float sums, rounded once.
    const float sum = static_cast<float>(power_sums[i]);
    const float norm = p == 1.0 || max_abs ? sum
                       : p == 2.0          ? std::sqrt(sum)
                                           : std::pow(sum, 1.0f / static_cast<float>(p));
    if (norm > max_norm) {  // embedding_renorm_'s rule
      rows.push_back(local[i]);
      scales.push_back(static_cast<float>(max_norm / (static_cast<double>(norm) + 1e-7)));
    }
  }
  SHARDSERVE_RETURN_IF_ERROR(kernels_.ScaleRows(table.shard(), rows.data(),
                                                static_cast<int64_t>(rows.size()), scales.data()));
  LogRenorm(table, rows, scales);  // a renorm changes the stored table: logged like an update
  return absl::OkStatus();
}

absl::Status ShardedOps::LeaveGroup(const absl::Status& status) {
  control_.Abort().IgnoreError();
  data_.Abort().IgnoreError();
  if (status.code() == absl::StatusCode::kUnavailable) return status;
  return absl::UnavailableError(absl::StrCat(
      "left the group in an op it could not finish with its peers: ", status.message()));
}

absl::Status ShardedOps::Exchange(const std::vector<int64_t>& send_counts,
                                  const std::vector<int64_t>& recv_counts,
                                  const BlockProducer& produce, std::vector<float>* staging,
                                  std::vector<const float*>* received, DeviceBuffer* storage) {
  const int world = data_.world_size();
  const int me = data_.rank();
  const int64_t recv_total = Sum(recv_counts);
  // Every rank takes part in every exchange, to its end: one that cannot (no memory for its
  // buffers, a kernel that failed while it computed a block) leaves the group.
  absl::StatusOr<DeviceBuffer> allocated = kernels_.Allocate(recv_total * sizeof(float));
  if (!allocated.ok()) return LeaveGroup(allocated.status());
  *storage = *std::move(allocated);
  allocated = kernels_.Allocate((Sum(send_counts) - send_counts[me]) * sizeof(float));
  if (!allocated.ok()) return LeaveGroup(allocated.status());
  DeviceBuffer blocks = *std::move(allocated);
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::unique_ptr<PendingExchange> exchange,
      data_.StartAllToAllV(storage->data(), recv_counts, send_counts, DataType::kFloat32,
                           options_.collective_timeout));
  std::vector<int64_t> offset(world, 0);  // peers' blocks only
  for (int q = 1; q < world; ++q)
    offset[q] = offset[q - 1] + (q - 1 == me ? 0 : send_counts[q - 1]);
  for (int k = 1; k < world; ++k) {
    const int dest = (me + k) % world;
    // Host kernels compute a block straight where the peer reads it, when the transport has such
    // memory (peers sharing memory).
    void* direct =
        kernels_.host_accessible() ? exchange->SendBuffer(dest, send_counts[dest]) : nullptr;
    float* block = direct != nullptr ? static_cast<float*>(direct) : blocks.floats() + offset[dest];
    if (absl::Status produced = produce(dest, block); !produced.ok()) return LeaveGroup(produced);
    if (send_counts[dest] > 0)
      SHARDSERVE_RETURN_IF_ERROR(exchange->Send(dest, block, send_counts[dest]));
  }
  // This rank's own block goes straight where it would be received (no copy).
  int64_t own = 0;
  for (int q = 0; q < me; ++q) own += recv_counts[q];
  if (absl::Status produced = produce(me, storage->floats() + own); !produced.ok()) {
    return LeaveGroup(produced);
  }
  SHARDSERVE_RETURN_IF_ERROR(exchange->Wait());
  const float* base = storage->floats();
  if (!kernels_.host_accessible() && staging != nullptr) {
    staging->resize(recv_total);
    SHARDSERVE_RETURN_IF_ERROR(
        kernels_.CopyToHost(storage->data(), staging->data(), recv_total * sizeof(float)));
    base = staging->data();
  }
  received->assign(world, nullptr);
  int64_t at = 0;
  for (int q = 0; q < world; at += recv_counts[q], ++q) {
    const void* elsewhere = exchange->Received(q);  // a peer's shared memory
    (*received)[q] = elsewhere != nullptr ? static_cast<const float*>(elsewhere) : base + at;
  }
  return absl::OkStatus();
}

absl::StatusOr<FloatBuffer> ShardedOps::AssembleColumns(const ShardLayout& layout, int64_t rows,
                                                        const std::vector<const float*>& blocks) {
  FloatBuffer out(rows * layout.n());  // every element is written below
  if (kernels_.host_accessible()) {
    SHARDSERVE_RETURN_IF_ERROR(PlaceColumns(layout, rows, blocks, /*skip=*/-1, out.data()));
    return out;
  }
  SHARDSERVE_ASSIGN_OR_RETURN(DeviceBuffer placed, kernels_.Allocate(out.size() * sizeof(float)));
  SHARDSERVE_RETURN_IF_ERROR(PlaceColumns(layout, rows, blocks, /*skip=*/-1, placed.floats()));
  SHARDSERVE_RETURN_IF_ERROR(
      kernels_.CopyToHost(placed.data(), out.data(), out.size() * sizeof(float)));
  return out;
}

absl::Status ShardedOps::PlaceColumns(const ShardLayout& layout, int64_t rows,
                                      const std::vector<const float*>& blocks, int skip,
                                      float* out) {
  for (int q = 0; q < layout.world_size(); ++q) {
    if (q == skip) continue;
    SHARDSERVE_RETURN_IF_ERROR(kernels_.PlaceColumns(blocks[q], rows, layout.SizeOfRank(q), out,
                                                     layout.n(), layout.OffsetOfRank(q)));
  }
  return absl::OkStatus();
}

absl::StatusOr<DenseResult> ShardedOps::Embedding(ShardedTable& table,
                                                  const GatheredInputs& g) {
  const TableConfig& config = table.config();
  if (absl::Status renormed = RenormLookedUpRows(table, g); !renormed.ok()) {
    return LeaveGroup(renormed);
  }

  const int me = data_.rank();
  const int world = data_.world_size();
  const int64_t dim = config.num_cols;
  const ShardLayout& layout = table.layout();
  const MatrixView shard = table.shard();
  const InputSource& mine = g.sources[me];
  std::vector<float> staging;
  std::vector<const float*> received;  // each rank's block
  DeviceBuffer storage;
  DenseResult result;
  if (config.spec.dim() == 1) {
    // Every rank holds a column chunk of every row: look up each source's ids, swap column blocks.
    // Host kernels write this rank's own columns straight into the result.
    const bool direct = kernels_.host_accessible();
    std::vector<int64_t> send = Scaled(g.NumIds(), shard.cols), recv(world);
    for (int q = 0; q < world; ++q) recv[q] = mine.num_ids * layout.SizeOfRank(q);
    if (direct) {
      send[me] = recv[me] = 0;
      result.values.resize(mine.num_ids * dim);
    }
    SHARDSERVE_RETURN_IF_ERROR(Exchange(
        send, recv,
        [&](int dest, float* block) {
          const InputSource& s = g.sources[dest];
          if (direct && dest == me) {
            return kernels_.GatherRows(shard, s.ids, s.num_ids,
                                       result.values.data() + layout.OffsetOfRank(me), dim);
          }
          return kernels_.GatherRows(shard, s.ids, s.num_ids, block, shard.cols);
        },
        /*staging=*/nullptr, &received, &storage));
    if (direct) {
      SHARDSERVE_RETURN_IF_ERROR(
          PlaceColumns(layout, mine.num_ids, received, me, result.values.data()));
    } else {
      SHARDSERVE_ASSIGN_OR_RETURN(result.values, AssembleColumns(layout, mine.num_ids, received));
    }
  } else {
    // Row chunks: each rank sends every source exactly the rows it owns of that source's ids.
    std::vector<int64_t> send(world, 0), recv(world, 0);
    std::vector<std::vector<int64_t>> local_rows(world);
    for (int s = 0; s < world; ++s) {
      for (int64_t i = 0; i < g.sources[s].num_ids; ++i) {
        const int64_t id = g.sources[s].ids[i];
        if (layout.OwnerOf(id) == me) local_rows[s].push_back(id - table.row_begin());
        if (s == me) ++recv[layout.OwnerOf(id)];
      }
      send[s] = static_cast<int64_t>(local_rows[s].size());
    }
    SHARDSERVE_RETURN_IF_ERROR(Exchange(
        Scaled(send, dim), Scaled(recv, dim),
        [&](int dest, float* block) {
          return kernels_.GatherRows(shard, local_rows[dest].data(), send[dest], block, dim);
        },
        &staging, &received, &storage));
    std::vector<int64_t> cursor(world, 0);  // next row of each owner's block
    result.values.resize(mine.num_ids * dim);
    for (int64_t i = 0; i < mine.num_ids; ++i) {
      const int owner = layout.OwnerOf(mine.ids[i]);
      std::memcpy(&result.values[i * dim], received[owner] + cursor[owner]++ * dim,
                  dim * sizeof(float));
    }
  }
  result.shape = {mine.num_ids, dim};
  return result;
}

absl::StatusOr<DenseResult> ShardedOps::EmbeddingBag(ShardedTable& table,
                                                     const GatheredInputs& g) {
  const TableConfig& config = table.config();
  if (absl::Status renormed = RenormLookedUpRows(table, g); !renormed.ok()) {
    return LeaveGroup(renormed);
  }

  const int me = data_.rank();
  const int world = data_.world_size();
  const int64_t dim = config.num_cols;
  const InputSource& mine = g.sources[me];
  const std::optional<int64_t> padding = config.padding_idx;
  const MatrixView shard = table.shard();
  std::vector<float> staging;
  std::vector<const float*> received;  // each rank's block
  DeviceBuffer storage;
  DenseResult result;
  if (config.spec.dim() == 1) {
    // Column chunks: pool each source's bags over this rank's columns, then swap column blocks.
    const ShardLayout& layout = table.layout();
    std::vector<int64_t> recv(world);
    for (int q = 0; q < world; ++q) recv[q] = mine.num_bags * layout.SizeOfRank(q);
    auto pool = [&](int s, float* block) -> absl::Status {
      const InputSource& src = g.sources[s];
      if (src.num_bags == 0) return absl::OkStatus();
      if (!padding.has_value()) {
        return kernels_.PoolBags(shard, BagsView{src.ids, src.offsets, src.weights, src.num_bags},
                                 src.mode, 0.0f, block, /*max_from=*/nullptr);
      }
      const int64_t pad = *padding;
      LocalBags kept = FilterBags(src.ids, src.offsets, src.weights, src.num_bags,
                                  [pad](int64_t id) { return id == pad ? -1 : id; });
      return kernels_.PoolBags(shard,
                               BagsView{kept.ids.data(), kept.offsets.data(),
                                        src.weights ? kept.weights.data() : nullptr, src.num_bags},
                               src.mode, 0.0f, block, /*max_from=*/nullptr);
    };
    SHARDSERVE_RETURN_IF_ERROR(Exchange(Scaled(g.NumBags(), shard.cols), recv, pool,
                                        /*staging=*/nullptr, &received, &storage));
    SHARDSERVE_ASSIGN_OR_RETURN(result.values, AssembleColumns(layout, mine.num_bags, received));
  } else {
    // Row chunks: pool each source's bags over the ids this rank owns, send each source its
    // partials, and reduce what comes back. Sum for sum/mean. Max, as ATen's over the whole bag,
    // needs more than a max of maxima (ReduceMaxBags): the rank that owns a bag's first row pools
    // its part from that row (the one whose NaN is the result), the others theirs from -inf, and
    // each sends, after its values, the index in its part of the row each came from.
    const int64_t begin = table.row_begin(), end = begin + shard.rows;
    const int64_t pad = padding.value_or(-1);
    auto local_row = [begin, end, pad](int64_t id) {
      return (id >= begin && id < end && id != pad) ? id - begin : -1;
    };
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    auto block_floats = [dim](const InputSource& src) {
      return src.num_bags * dim * (src.mode == PoolMode::kMax ? 2 : 1);
    };
    auto pool = [&](int s, float* block) -> absl::Status {
      const InputSource& src = g.sources[s];
      if (src.num_bags == 0) return absl::OkStatus();
      LocalBags kept = FilterBags(src.ids, src.offsets, src.weights, src.num_bags, local_row);
      BagsView view{kept.ids.data(), kept.offsets.data(),
                    src.weights ? kept.weights.data() : nullptr, src.num_bags};
      if (src.mode != PoolMode::kMax) {
        return kernels_.PoolBags(shard, view, PoolMode::kSum, 0.0f, block, /*max_from=*/nullptr);
      }
      std::vector<uint8_t> continued(src.num_bags, 0);
      for (int64_t b = 0; b < src.num_bags; ++b) {
        for (int64_t j = src.offsets[b]; j < src.offsets[b + 1]; ++j) {
          if (src.ids[j] == pad) continue;
          continued[b] = local_row(src.ids[j]) < 0 ? 1 : 0;
          break;
        }
      }
      view.continued = continued.data();
      return kernels_.PoolBags(shard, view, PoolMode::kMax, kNegInf, block,
                               reinterpret_cast<int32_t*>(block + src.num_bags * dim));
    };
    std::vector<int64_t> send(world);
    for (int q = 0; q < world; ++q) send[q] = block_floats(g.sources[q]);
    SHARDSERVE_RETURN_IF_ERROR(Exchange(send, std::vector<int64_t>(world, block_floats(mine)),
                                        pool, &staging, &received, &storage));
    if (mine.mode == PoolMode::kMax) {
      SHARDSERVE_ASSIGN_OR_RETURN(result.values,
                                  ReduceMaxBags(received, mine.ids, mine.offsets, mine.num_bags,
                                                dim, table.layout(), pad));
    } else {
      result.values = ReduceBlocks(received, mine.num_bags * dim);
    }
    if (mine.mode == PoolMode::kMean) {
      // Divide by the ids that took part in each bag (padding excluded).
      for (int64_t b = 0; b < mine.num_bags; ++b) {
        int64_t count = 0;
        for (int64_t j = mine.offsets[b]; j < mine.offsets[b + 1]; ++j) {
          count += mine.ids[j] != pad ? 1 : 0;
        }
        float* row = &result.values[b * dim];
        if (count > 0) {
          for (int64_t j = 0; j < dim; ++j) row[j] /= static_cast<float>(count);
        }
      }
    }
  }
  result.shape = {mine.num_bags, dim};
  return result;
}

absl::StatusOr<DenseResult> ShardedOps::Linear(ShardedTable& table, const GatheredInputs& g) {
  const TableConfig& config = table.config();
  const int world = data_.world_size();
  const int me = data_.rank();
  const int64_t in = config.num_cols, out_features = config.num_rows;
  const std::vector<int64_t> rows_of = g.NumIds();  // input rows per source
  const int64_t my_rows = rows_of[me];

  const MatrixView shard = table.shard();
  const float* bias = table.bias().empty() ? nullptr : table.bias().data();
  std::vector<float> staging;
  std::vector<const float*> received;  // each rank's block
  DeviceBuffer storage;
  DenseResult result;
  if (config.spec.dim() == 0) {
    // Output features are split: this rank computes its output columns for every source's rows.
    const ShardLayout& layout = table.layout();
    std::vector<int64_t> recv(world);
    for (int q = 0; q < world; ++q) recv[q] = my_rows * layout.SizeOfRank(q);
    SHARDSERVE_RETURN_IF_ERROR(Exchange(
        Scaled(rows_of, shard.rows), recv,
        [&](int s, float* block) {
          return kernels_.Linear(g.sources[s].rows, rows_of[s], in, 0, shard,
                                 bias ? bias + table.row_begin() : nullptr, block);
        },
        /*staging=*/nullptr, &received, &storage));
    SHARDSERVE_ASSIGN_OR_RETURN(result.values, AssembleColumns(layout, my_rows, received));
  } else {
    // Input features are split: partial products over this rank's inputs, summed across ranks,
    // and the bias added once, after the sum.
    const int64_t size = my_rows * out_features;
    SHARDSERVE_RETURN_IF_ERROR(Exchange(
        Scaled(rows_of, out_features), std::vector<int64_t>(world, size),
        [&](int s, float* block) {
          return kernels_.Linear(g.sources[s].rows, rows_of[s], in, table.col_begin(), shard,
                                 nullptr, block);
        },
        &staging, &received, &storage));
    result.values = ReduceBlocks(received, size);
    if (bias != nullptr) {
      for (int64_t r = 0; r < my_rows; ++r) {
        for (int64_t j = 0; j < out_features; ++j) result.values[r * out_features + j] += bias[j];
      }
    }
  }
  result.shape = {my_rows, out_features};
  return result;
}

}  // namespace shardserve::core
