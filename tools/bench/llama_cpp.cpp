// llama.cpp's prefill and decode speed on a GGUF file, through the reference script in a child
// process (its stdout is `key value` lines; its stderr goes to ours, so its errors are seen).
#include "tools/bench/llama_cpp.h"

#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <vector>

#include "kernels/base/error.h"

extern char** environ;

namespace tandem::cli {

std::string default_llama_cpp_dir() { return std::string(TANDEM_SOURCE_DIR) + "/tests/reference/llama_cpp"; }

void require_llama_cpp(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string script = dir + "/greedy.mjs";
  if (!fs::exists(script) || !fs::exists(dir + "/node_modules/node-llama-cpp"))
    throw tandem::error(fmt::format("--compare-llama-cpp needs {} and its npm packages: run `npm ci --omit=optional` "
                                    "in {} (tests/run.sh does), or point --llama-cpp-dir at such a folder",
                                    script, dir));
}

llama_cpp_speed run_llama_cpp_bench(const std::string& dir, const std::string& model, int32_t threads, int64_t prompt,
                                    int64_t context, int64_t steps, const std::string& kv_cache_dtype) {
  require_llama_cpp(dir);
  const std::string script = dir + "/greedy.mjs";
  std::vector<std::string> args{"node", script, "bench", "--model", model, "--threads", std::to_string(threads),
                                "--prompt", std::to_string(prompt), "--context", std::to_string(context),
                                "--steps", std::to_string(steps), "--kv-cache-dtype", kv_cache_dtype};
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  int out[2];
  if (::pipe(out) != 0) throw tandem::error("--compare-llama-cpp: pipe() failed");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "node", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(out[1]);
  std::string text;
  char buf[4096];
  ssize_t k;
  while (rc == 0 && (k = ::read(out[0], buf, sizeof buf)) > 0) text.append(buf, size_t(k));
  ::close(out[0]);
  if (rc != 0) throw tandem::error("--compare-llama-cpp: could not start `node` (is Node.js 20+ on PATH?)");
  int status = 0;
  ::waitpid(pid, &status, 0);
  llama_cpp_speed s;
  std::istringstream lines(text);
  for (std::string key; lines >> key;) {
    double v = 0;
    lines >> v;
    if (key == "prefill_tokens_per_s") s.prefill_tokens_per_s = v;
    if (key == "decode_tokens_per_s") s.decode_tokens_per_s = v;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || s.prefill_tokens_per_s <= 0 || s.decode_tokens_per_s <= 0)
    throw tandem::error(fmt::format("--compare-llama-cpp: `node {} bench --model {}` failed (exit status {}; its "
                                    "errors are above); output: {}",
                                    script, model, WIFEXITED(status) ? WEXITSTATUS(status) : -1, text));
  return s;
}

}  // namespace tandem::cli
