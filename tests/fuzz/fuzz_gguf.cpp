// libFuzzer target: the GGUF reader on a memory buffer (every model file is untrusted input
// until parsed): header, metadata, tensor infos, offsets and sizes against the buffer; then
// the block decoders on the first and last row of every tensor Tandem can compute with.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/quant_ref.h"
#include "kernels/gguf/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto f = tandem::gguf::file::parse(std::span<const uint8_t>(data, size));
    // Touch what a loader touches: every key and every tensor's bytes.
    std::vector<float> row;
    for (const auto& t : f.tensors()) {
      if (t.nbytes == 0) continue;
      auto* b = static_cast<const uint8_t*>(t.data);
      // The first and last byte of every tensor must lie in the buffer (ASan checks).
      volatile uint8_t sink = static_cast<uint8_t>(b[0] ^ b[t.nbytes - 1]);
      (void)sink;
      try {
        const tandem::tensor_view v = t.view();
        // Rows of at most 64 Ki elements (a fuzzed shape may be huge; the bytes are in the buffer).
        if (v.cols() > (int64_t(1) << 16)) continue;
        row.resize(size_t(v.cols()));
        for (int64_t r : {int64_t(0), v.rows() - 1}) {
          tandem::cpu::dequantize_row_ref(v.type, v.row(r), row.data(), v.cols());
          volatile float s = row[0] + row[row.size() - 1];
          (void)s;
        }
      } catch (const std::exception&) {
      }
    }
    (void)f.find("general.architecture");
  } catch (const std::exception&) {
  }
  return 0;
}
