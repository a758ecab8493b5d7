#pragma once
// Random-weight model files for the actor tests: each written once per test process under its
// tag (the first caller's options) and removed at exit.
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>

#include "kernels/model/make_model.h"

namespace tandem::test {

inline const std::string& test_model_file(const std::string& tag, const make_model_options& o) {
  static std::map<std::string, std::string> paths;
  static struct cleanup {
    ~cleanup() {
      for (auto& [t, p] : paths) std::filesystem::remove(p);
    }
  } c;
  auto& path = paths[tag];
  if (path.empty()) {
    path = (std::filesystem::temp_directory_path() / ("tandem_actors_" + tag + "_" + std::to_string(getpid()) + ".gguf"))
               .string();
    write_random_llama(o, path);
  }
  return path;
}

/// A micro model of `arch` with weights from `seed` (tagged by both).
inline std::string micro_model_file(const std::string& arch, uint64_t seed) {
  make_model_options o;
  o.preset = "micro";
  o.arch = arch;
  o.seed = seed;
  return test_model_file("micro_" + arch + "_" + std::to_string(seed), o);
}

}  // namespace tandem::test
