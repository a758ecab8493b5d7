#include "kernels/model/arch/registry.h"

#include <fmt/format.h>

#include <array>
#include <set>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/model/arch/gemma2.h"
#include "kernels/model/arch/llama.h"
#include "kernels/model/arch/qwen2.h"
#include "kernels/model/arch/qwen3.h"

namespace tandem::arch {

std::span<const architecture* const> architectures() {
  static const std::array<const architecture*, 4> all{&llama_architecture(), &qwen2_architecture(),
                                                      &qwen3_architecture(), &gemma2_architecture()};
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

namespace {

/// The file's tensors no view of `w` points at, e.g. the biases of a qwen2 file relabelled
/// llama: running without them would be a different model, so loading refuses.
std::vector<std::string> unused_tensors(const gguf::file& f, const llama_weights& w) {
  std::set<const void*> used = {w.token_embd.data, w.output_norm.data, w.output.data, w.rope_freqs.data};
  for (const auto& L : w.layers)
    for (const tensor_view* t : {&L.attn_norm, &L.attn_q, &L.attn_k, &L.attn_v, &L.attn_output, &L.ffn_norm,
                                 &L.ffn_gate, &L.ffn_up, &L.ffn_down, &L.attn_q_bias, &L.attn_k_bias, &L.attn_v_bias,
                                 &L.attn_q_norm, &L.attn_k_norm, &L.attn_post_norm, &L.ffn_post_norm})
      used.insert(t->data);
  std::vector<std::string> out;
  for (const auto& t : f.tensors())
    if (t.nbytes > 0 && used.count(t.data) == 0) out.push_back(t.name);
  return out;
}

}  // namespace

std::unique_ptr<llama_model> load(const gguf::file& f, const cpu_options& opt) {
  const architecture& a = of(f);
  llama_weights w = a.read_weights(f, a.read_config(f));
  if (const auto unused = unused_tensors(f, w); !unused.empty())
    throw tandem::error(fmt::format("{}: {} tensor(s) that a '{}' model does not have, e.g. {}; the file's "
                                    "general.architecture does not match its tensors",
                                    f.name(), unused.size(), a.name, unused.front()));
  return make_cpu_llama(w, opt);
}

}  // namespace tandem::arch
