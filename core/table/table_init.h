// Seeded initial values of a table, element by element: the value at (row, col) depends only on
// the seed and the position, so every rank fills its own chunk and the full table is the same
// whatever the sharding. Distributions follow PyTorch's defaults: nn.Embedding's N(0, 1) with the
// padding row zero; nn.Linear's kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)), for
// the weight and the bias. (Counter-based, so the values are not torch.manual_seed's.)
#ifndef SHARDSERVE_CORE_TABLE_TABLE_INIT_H_
#define SHARDSERVE_CORE_TABLE_TABLE_INIT_H_

#include <cstdint>

#include "core/table/table_config.h"

namespace shardserve::core {

// Fills out (rows x cols, row-major) with the block [row_begin, +rows) x [col_begin, +cols).
void FillSeededWeight(const TableConfig& table, uint64_t seed, int64_t row_begin, int64_t rows,
                      int64_t col_begin, int64_t cols, float* out);
// Fills out (num_rows entries) with a linear layer's bias.
void FillSeededBias(const TableConfig& table, uint64_t seed, float* out);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TABLE_TABLE_INIT_H_
