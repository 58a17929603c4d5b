#include "core/table/sharding_spec.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"

namespace shardserve::core {
namespace {

absl::Status ParseError(absl::string_view field, absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": cannot parse \"", text, "\": ", why));
}

}  // namespace

absl::StatusOr<Placement> Placement::Parse(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, '/');
  if (parts.size() > 2) {
    return ParseError("placement", text, "expected rank:<rank>/<device>");
  }
  absl::string_view worker = parts[0];
  if (!absl::StartsWith(worker, "rank:")) {
    return ParseError("placement", text, "expected rank:<rank>/<device>");
  }
  Placement placement;
  absl::string_view digits = worker.substr(5);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(),
                                     [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(digits, &placement.rank)) {
    return ParseError("placement", text, "rank must be a non-negative integer");
  }
  if (parts.size() == 2) {
    absl::StatusOr<Device> device = Device::Parse(parts[1]);
    if (!device.ok()) {
      return ParseError("placement", text, device.status().message());
    }
    placement.device = *device;
  }
  return placement;
}

std::string Placement::ToString() const {
  return absl::StrCat("rank:", rank, "/", device.ToString());
}

int64_t SplitSize(int64_t n, int64_t chunks) { return (n + chunks - 1) / chunks; }

int64_t ChunkedDimSize(int64_t n, int64_t split, int64_t idx) {
  return std::max<int64_t>(std::min(n, split * (idx + 1)) - split * idx, 0);
}

ShardingSpec::ShardingSpec(int dim, std::vector<Placement> placements, int world_size)
    : dim_(dim), placements_(std::move(placements)), placement_index_of_rank_(world_size, -1) {
  for (size_t idx = 0; idx < placements_.size(); ++idx) {
    placement_index_of_rank_[placements_[idx].rank] = static_cast<int>(idx);
  }
}

absl::StatusOr<ShardingSpec> ShardingSpec::Create(int dim, std::vector<Placement> placements) {
  const int world = static_cast<int>(placements.size());
  return Create(dim, std::move(placements), world);
}

absl::StatusOr<ShardingSpec> ShardingSpec::Create(int dim, std::vector<Placement> placements,
                                                  int world_size) {
  if (dim != 0 && dim != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharding dim: ", dim, " is not supported; must be 0 or 1 of a 2-D weight"));
  }
  if (placements.empty()) {
    return absl::InvalidArgumentError("placements: must name at least one rank");
  }
  if (static_cast<int64_t>(placements.size()) > world_size) {
    return absl::InvalidArgumentError(absl::StrCat("placements: ", placements.size(),
                                                   " placements, but the group has ", world_size,
                                                   " ranks"));
  }
  const int world = world_size;
  std::vector<bool> seen(world, false);
  for (const Placement& p : placements) {
    if (p.rank < 0 || p.rank >= world) {
      return absl::InvalidArgumentError(absl::StrCat("placements: rank ", p.rank,
                                                     " is out of range [0, ", world, ")"));
    }
    if (seen[p.rank]) {
      return absl::InvalidArgumentError(
          absl::StrCat("placements: rank ", p.rank, " appears more than once"));
    }
    seen[p.rank] = true;
  }
  return ShardingSpec(dim, std::move(placements), world);
}

absl::StatusOr<ShardingSpec> ShardingSpec::Create(int dim,
                                                  const std::vector<std::string>& placements) {
  return Create(dim, placements, static_cast<int>(placements.size()));
}

absl::StatusOr<ShardingSpec> ShardingSpec::Create(int dim,
                                                  const std::vector<std::string>& placements,
                                                  int world_size) {
  std::vector<Placement> parsed;
  parsed.reserve(placements.size());
  for (const std::string& text : placements) {
    SHARDSERVE_ASSIGN_OR_RETURN(Placement p, Placement::Parse(text));
    parsed.push_back(p);
  }
  return Create(dim, std::move(parsed), world_size);
}

ShardingSpec ShardingSpec::Contiguous(int dim, int world_size, Device device) {
  std::vector<Placement> placements(world_size);
  for (int r = 0; r < world_size; ++r) placements[r] = Placement{r, device};
  return ShardingSpec(dim, std::move(placements), world_size);
}

bool ShardingSpec::IsIdentityOrder() const {
  if (num_chunks() != world_size()) return false;
  for (size_t idx = 0; idx < placements_.size(); ++idx) {
    if (placements_[idx].rank != static_cast<int>(idx)) return false;
  }
  return true;
}

std::string ShardingSpec::ToString() const {
  return absl::StrCat("ChunkShardingSpec(dim=", dim_, ", placements=[",
                      absl::StrJoin(placements_, ", ",
                                    [](std::string* out, const Placement& p) {
                                      out->append(p.ToString());
                                    }),
                      "]",
                      // (Only where it differs: the text of specs over every rank is unchanged.)
                      num_chunks() == world_size() ? "" : absl::StrCat(", world=", world_size()),
                      ")");
}

ShardLayout::ShardLayout(const ShardingSpec& spec, int64_t n)
    : n_(n),
      split_(std::max<int64_t>(SplitSize(n, spec.num_chunks()), 1)),
      offset_of_rank_(spec.world_size(), n),
      size_of_rank_(spec.world_size(), 0),
      owner_of_chunk_(spec.num_chunks()) {
  // Chunk idx starts at split*idx (torch.chunk); the cumulative sum of earlier sizes is the same
  // number, and for empty chunks it is clamped to n. Ranks without a placement keep (n, 0): an
  // empty chunk at the end, which every op already handles.
  for (int idx = 0; idx < spec.num_chunks(); ++idx) {
    const int rank = spec.placements()[idx].rank;
    owner_of_chunk_[idx] = rank;
    size_of_rank_[rank] = ChunkedDimSize(n, split_, idx);
    offset_of_rank_[rank] = std::min(n, split_ * idx);
  }
}

}  // namespace shardserve::core
