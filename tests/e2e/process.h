#pragma once
// Child processes for end-to-end tests: the real `tandem` binary. A child dies with the test
// (PR_SET_PDEATHSIG) and is killed and reaped by the destructor, so no server outlives a
// failing test.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/model/make_model.h"

namespace tandem::e2e {

class child {
 public:
  /// Starts `argv` with stdout on a pipe (stderr to `stderr_path` if given, else inherited).
  explicit child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                 const std::string& stderr_path = "") {
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::dup2(out[1], 1);
      if (!stderr_path.empty()) {
        int fd = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) ::dup2(fd, 2);
      }
      for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> a;
      for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
      a.push_back(nullptr);
      ::execv(a[0], a.data());
      ::_exit(127);
    }
    ::close(out[1]);
    out_ = out[0];
  }
  ~child() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGTERM);
      if (!wait_exit(std::chrono::seconds(5))) {
        ::kill(pid_, SIGKILL);
        wait_exit(std::chrono::seconds(5));
      }
    }
    if (out_ >= 0) ::close(out_);
  }
  child(const child&) = delete;
  child& operator=(const child&) = delete;

  /// Next stdout line, or nullopt on EOF/timeout.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char b[4096];
      ssize_t n = ::read(out_, b, sizeof b);
      if (n <= 0) return std::nullopt;
      buf_.append(b, static_cast<size_t>(n));
    }
  }
  /// All remaining stdout until EOF (or timeout).
  std::string read_all(std::chrono::milliseconds timeout) {
    std::string all;
    while (auto l = read_line(timeout)) all += *l + "\n";
    all += std::exchange(buf_, {});
    return all;
  }
  /// Waits for exit; returns the exit code, or -1 on timeout / signal.
  int wait(std::chrono::milliseconds timeout) {
    if (!wait_exit(timeout)) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }
  pid_t pid() const { return pid_; }

 private:
  bool wait_exit(std::chrono::milliseconds timeout) {
    if (exited_) return true;
    auto until = std::chrono::steady_clock::now() + timeout;
    while (true) {
      pid_t r = ::waitpid(pid_, &status_, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return true;
      }
      if (std::chrono::steady_clock::now() >= until) return false;
      // Reaping has no fd to wait on; poll at a fine grain with a hard deadline.
      ::usleep(2000);
    }
  }

  pid_t pid_ = -1;
  int out_ = -1;
  int status_ = 0;
  bool exited_ = false;
  std::string buf_;
};

/// A fresh temporary directory, removed at the end.
struct temp_dir {
  temp_dir() {
    std::string t = (std::filesystem::temp_directory_path() / "tandem-e2e-XXXXXX").string();
    if (!::mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
    path = t;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::filesystem::path path;
};

/// `tandem serve` on free ports, with the ports parsed from its listening lines. With
/// "--admin-port" among `extra`, the admin port is waited for too.
struct server {
  /// `extra` are more `tandem serve` flags, e.g. {"--max-queued-requests", "1"}.
  explicit server(const std::string& model, const std::string& stderr_path, const std::vector<std::string>& extra = {})
      : proc(argv(model, extra), {}, stderr_path) {
    const bool want_admin = std::find(extra.begin(), extra.end(), "--admin-port") != extra.end();
    std::regex re(R"(^tandem: (http|rpc|admin) listening on 127\.0\.0\.1:(\d+)$)");
    while (http_port == 0 || rpc_port == 0 || (want_admin && admin_port == 0)) {
      auto line = proc.read_line(std::chrono::seconds(20));
      if (!line) throw std::runtime_error("tandem serve did not print its listening lines; see " + stderr_path);
      std::smatch m;
      if (!std::regex_match(*line, m, re)) throw std::runtime_error("unexpected stdout line from tandem serve: " + *line);
      const auto port = static_cast<uint16_t>(std::stoi(m[2]));
      (m[1] == "http" ? http_port : m[1] == "rpc" ? rpc_port : admin_port) = port;
    }
  }
  static std::vector<std::string> argv(const std::string& model, const std::vector<std::string>& extra) {
    std::vector<std::string> a{TANDEM_BINARY, "serve", "--model", model, "--port", "0", "--rpc-port", "0", "--log-level", "warn"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  child proc;
  uint16_t http_port = 0, rpc_port = 0, admin_port = 0;
};

/// Writes the micro preset (f16, seed 7) to `dir`/micro.gguf and returns its path.
inline std::string write_micro_model(const std::filesystem::path& dir) {
  const std::string path = (dir / "micro.gguf").string();
  make_model_options o;
  o.preset = "micro";
  o.dtype = ggml_type::f16;
  o.seed = 7;
  write_random_llama(o, path);
  return path;
}

}  // namespace tandem::e2e
