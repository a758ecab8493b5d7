#pragma once
/// The architecture layer: one module per `general.architecture` (llama.cpp's names and
/// metadata keys), each reading its hyper-parameters and weights from a GGUF file. The
/// registry maps the name to its module; an unknown name is refused naming the supported ones.
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "kernels/model/arch/dense_forward.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"

namespace tandem::arch {

/// What an architecture module provides.
struct architecture {
  std::string_view name;  ///< general.architecture, as llama.cpp spells it
  /// Hyper-parameters from metadata alone (check-config sizes KV pools with it without
  /// touching the weights; the loader uses the same function, so both agree).
  model_config (*read_config)(const gguf::file& f);
  /// The CPU model of `f` (config `c` from read_config), its weights views into the file.
  /// Throws naming a missing or mis-shaped tensor, and refuses a file carrying tensors the
  /// architecture does not use (refuse_unused_tensors).
  std::unique_ptr<llama_model> (*load)(const gguf::file& f, const model_config& c, const cpu_options& opt);
};

/// Every architecture Tandem loads, in a stable order.
std::span<const architecture* const> architectures();
/// "llama, qwen2, qwen3, gemma2, deepseek2"
std::string supported_names();
/// The module for `name`, or nullptr.
const architecture* find(std::string_view name);
/// The module of a file's `general.architecture` ("llama" when the key is absent, as older
/// files have it). Throws tandem::error (unimplemented) naming the architecture and the
/// supported ones.
const architecture& of(const gguf::file& f);

/// Throws naming one of the file's tensors that no pointer in `used` points at, e.g. the
/// biases of a qwen2 file relabelled llama: running without them would be a different model.
void refuse_unused_tensors(const gguf::file& f, std::string_view arch, const std::set<const void*>& used);

/// of(f).read_config(f).
model_config read_config(const gguf::file& f);
/// Loads the CPU model of `f` with its architecture's module.
std::unique_ptr<llama_model> load(const gguf::file& f, const cpu_options& opt = {});

}  // namespace tandem::arch
