#include "kernels/cpu/weight_check.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"

namespace tandem::cpu {

void check_weight(const tensor_view& t, const std::string& name, int64_t cols, int64_t rows, int64_t mats) {
  if (t.data == nullptr) throw tandem::error(fmt::format("model tensor {} is missing", name));
  if (!is_supported(t.type))
    throw tandem::error(fmt::format("model tensor {} has type {}; supported are {}", name, to_string(t.type),
                                    supported_types_list));
  if (t.cols() != cols || t.ne[1] != rows || t.ne[2] * t.ne[3] != mats) {
    if (mats == 1)
      throw tandem::error(fmt::format("model tensor {} is {}x{} (cols x rows), expected {}x{}", name, t.cols(),
                                      t.rows(), cols, rows));
    throw tandem::error(fmt::format("model tensor {} is {}x{}x{} (cols x rows x matrices), expected {}x{}x{}", name,
                                    t.cols(), t.ne[1], t.ne[2] * t.ne[3], cols, rows, mats));
  }
  if (cols % block_elems(t.type) != 0)
    throw tandem::error(fmt::format("model tensor {} is {} with {} columns, not a multiple of its block of {}", name,
                                    to_string(t.type), cols, block_elems(t.type)));
  const size_t need = row_bytes(t.type, cols) * size_t(rows) * size_t(mats);
  if (t.nbytes != 0 && t.nbytes < need)
    throw tandem::error(fmt::format("model tensor {} holds {} bytes, needs {}", name, t.nbytes, need));
}

std::vector<float> vector_weight(const tensor_view& t, const std::string& name, int64_t n) {
  check_weight(t, name, n, 1);
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(t.type, t.row(0), out.data(), n);
  return out;
}

std::vector<float> optional_vector_weight(const tensor_view& t, const std::string& name, int64_t n) {
  if (t.data == nullptr) return {};
  return vector_weight(t, name, n);
}

}  // namespace tandem::cpu
