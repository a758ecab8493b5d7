#include "kernels/model/arch/llama.h"

#include "kernels/model/arch/dense.h"

namespace tandem::arch {

namespace {

model_config config_of(const gguf::file& f) { return read_dense_config(f, "llama", rope_kind::normal); }

}  // namespace

const architecture& llama_architecture() {
  static constexpr architecture a{"llama", config_of, load_dense<read_dense_weights>};
  return a;
}

}  // namespace tandem::arch
