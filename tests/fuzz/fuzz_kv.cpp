// libFuzzer target: what a KV peer sends over UCX before any page moves: the handshake
// (decode_hello, check_compatible) and the page descriptors (decode_descriptors,
// check_page_ids). First byte: 0 = hello, 1 = descriptors; the rest is the message.
#include <cstdint>
#include <cstdlib>

#include "kernels/base/error.h"
#include "transport/ucx/kv_handshake.h"

namespace {

tandem::ucx::kv_identity local() {
  tandem::ucx::kv_identity id;
  id.node = "local";
  id.model = "r15m";
  id.layout.n_layers = 2;
  id.layout.n_kv_heads = 2;
  id.layout.head_dim = 8;
  id.layout.page_size = 16;
  return id;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using namespace tandem::ucx;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  try {
    if (data[0] % 2 == 0) {
      kv_hello h = decode_hello(p, n);
      if (h.n_pages <= 0) std::abort();  // decode_hello must refuse an empty pool
      // Re-encoding what was accepted gives the same bytes: nothing is silently dropped.
      auto again = encode_hello(h);
      if (again.size() != n || !std::equal(again.begin(), again.end(), p)) std::abort();
      (void)check_compatible(local(), h.id);
      (void)h.id.describe();
    } else {
      kv_descriptors d = decode_descriptors(p, n);
      auto again = encode_descriptors(d);
      if (again.size() != n || !std::equal(again.begin(), again.end(), p)) std::abort();
      std::string why = check_page_ids(d.pages, 64);
      for (int32_t pg : d.pages)
        if ((pg < 0 || pg >= 64) && why.empty()) std::abort();  // an out-of-pool page must be named
    }
  } catch (const tandem::error&) {
  }
  return 0;
}
