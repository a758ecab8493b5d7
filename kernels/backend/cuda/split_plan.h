#pragma once
/// The host's side of split-context attention (split_softmax.h): which rows split, where each
/// split row's partials go, and how a call is cut into pieces whose partials fit a bound (a
/// long prefill chunk would otherwise need partials for every one of its rows at once). A
/// row's splits depend only on the row, so the pieces change launches, never bits.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend/cuda/split_softmax.h"

namespace tandem::cuda_backend {

/// Rows [first_row, first_row + n_rows) of a call, launched together.
struct split_piece {
  int64_t first_row = 0, n_rows = 0;
  int32_t n_partials = 0;  ///< partials of its split rows (0: no row splits)
  int32_t max_splits = 1;  ///< the largest split_count of its rows
};

/// Sets each split row's split_base (its first partial's index within its piece; 0 for rows
/// of one split) and cuts the rows into pieces of at most `max_partials` partials; a row that
/// alone needs more gets a piece of its own. Row: any type with lo, pos and split_base.
template <class Row>
std::vector<split_piece> plan_splits(std::span<Row> rows, int64_t max_partials) {
  std::vector<split_piece> pieces;
  split_piece cur;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int n = split_count(rows[i].lo, rows[i].pos);
    const int32_t need = n > 1 ? n : 0;
    if (cur.n_rows > 0 && need > 0 && int64_t(cur.n_partials) + need > max_partials) {
      pieces.push_back(cur);
      cur = split_piece{.first_row = int64_t(i)};
    }
    rows[i].split_base = need > 0 ? cur.n_partials : 0;
    cur.n_partials += need;
    cur.max_splits = std::max(cur.max_splits, n);
    ++cur.n_rows;
  }
  if (cur.n_rows > 0) pieces.push_back(cur);
  return pieces;
}

}  // namespace tandem::cuda_backend
