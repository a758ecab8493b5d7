// libFuzzer target: the GGUF reader on a memory buffer (every model file is untrusted input
// until parsed): header, metadata, tensor infos, offsets and sizes against the buffer.
#include <cstdint>
#include <span>

#include "kernels/gguf/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto f = tandem::gguf::file::parse(std::span<const uint8_t>(data, size));
    // Touch what a loader touches: every key and every tensor's bytes.
    for (const auto& t : f.tensors()) {
      if (t.nbytes == 0) continue;
      auto* b = static_cast<const uint8_t*>(t.data);
      // The first and last byte of every tensor must lie in the buffer (ASan checks).
      volatile uint8_t sink = static_cast<uint8_t>(b[0] ^ b[t.nbytes - 1]);
      (void)sink;
      try {
        (void)t.view();
      } catch (const std::exception&) {
      }
    }
    (void)f.find("general.architecture");
  } catch (const std::exception&) {
  }
  return 0;
}
