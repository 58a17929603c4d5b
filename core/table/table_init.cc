#include "core/table/table_init.h"

#include <cmath>

namespace shardserve::core {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) for stream `stream`, element `index`.
double Uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = Mix(Mix(seed ^ (stream * 0xd1b54a32d192ed03ULL)) + index);
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

}  // namespace

void FillSeededWeight(const TableConfig& table, uint64_t seed, int64_t row_begin, int64_t rows,
                      int64_t col_begin, int64_t cols, float* out) {
  if (cols == 0) return;  // an empty shard of a table with very many rows: nothing to visit
  const double bound = 1.0 / std::sqrt(static_cast<double>(table.num_cols));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r;
    const bool padding = table.padding_idx.has_value() && *table.padding_idx == row;
    for (int64_t c = 0; c < cols; ++c) {
      const uint64_t index = static_cast<uint64_t>(row) * table.num_cols + col_begin + c;
      double v;
      if (padding) {
        v = 0;
      } else if (table.kind == TableKind::kEmbedding) {  // Box-Muller
        const double u1 = Uniform(seed, 1, index), u2 = Uniform(seed, 2, index);
        v = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
      } else {
        v = (2.0 * Uniform(seed, 3, index) - 1.0) * bound;
      }
      out[r * cols + c] = static_cast<float>(v);
    }
  }
}

void FillSeededBias(const TableConfig& table, uint64_t seed, float* out) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(table.num_cols));
  for (int64_t i = 0; i < table.num_rows; ++i) {
    out[i] = static_cast<float>((2.0 * Uniform(seed, 4, i) - 1.0) * bound);
  }
}

}  // namespace shardserve::core
