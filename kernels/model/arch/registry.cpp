#include "kernels/model/arch/registry.h"

#include <fmt/format.h>

#include <array>
#include <string>

#include "kernels/base/error.h"
#include "kernels/model/arch/deepseek2.h"
#include "kernels/model/arch/gemma2.h"
#include "kernels/model/arch/llama.h"
#include "kernels/model/arch/qwen2.h"
#include "kernels/model/arch/qwen3.h"

namespace tandem::arch {

std::span<const architecture* const> architectures() {
  static const std::array<const architecture*, 5> all{&llama_architecture(), &qwen2_architecture(),
                                                      &qwen3_architecture(), &gemma2_architecture(),
                                                      &deepseek2_architecture()};
  return all;
}

std::string supported_names() {
  std::string out;
  for (const architecture* a : architectures()) out += (out.empty() ? "" : ", ") + std::string(a->name);
  return out;
}

const architecture* find(std::string_view name) {
  for (const architecture* a : architectures())
    if (a->name == name) return a;
  return nullptr;
}

const architecture& of(const gguf::file& f) {
  const auto* v = f.find("general.architecture");
  const std::string name = v != nullptr ? v->as_string() : "llama";
  if (const architecture* a = find(name)) return *a;
  throw tandem::error(error_kind::unimplemented,
                      fmt::format("{}: architecture '{}' is not supported; supported are {}", f.name(), name,
                                  supported_names()));
}

model_config read_config(const gguf::file& f) { return of(f).read_config(f); }

void refuse_unused_tensors(const gguf::file& f, std::string_view arch, const std::set<const void*>& used) {
  size_t n = 0;
  std::string first;
  for (const auto& t : f.tensors())
    if (t.nbytes > 0 && used.count(t.data) == 0 && n++ == 0) first = t.name;
  if (n > 0)
    throw tandem::error(fmt::format("{}: {} tensor(s) that a '{}' model does not have, e.g. {}; the file's "
                                    "general.architecture does not match its tensors",
                                    f.name(), n, arch, first));
}

std::unique_ptr<llama_model> load(const gguf::file& f, const cpu_options& opt) {
  const architecture& a = of(f);
  return a.load(f, a.read_config(f), opt);
}

}  // namespace tandem::arch
