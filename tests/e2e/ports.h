#pragma once
/// Fixed TCP ports for the nodes a test starts (their configs need them up front).
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::e2e {

/// Claims `port` for this test process until it exits: an exclusive flock on
/// <tmp>/tandem-test-ports/<port>. Test processes that run side by side (ctest -j) each
/// pick ports at random, and a port free when one checked it could be bound by another's
/// node before its own node listened ("Address already in use", seen once in a few hundred
/// runs of three at once). The kernel drops the lock when the process ends, however it ends.
inline bool claim_port(uint16_t port) {
  static std::mutex mu;
  static std::vector<int> held;  // open for the process's life: closing one would drop its lock
  const std::lock_guard lk(mu);
  std::error_code ec;
  const auto dir = std::filesystem::temp_directory_path(ec) / "tandem-test-ports";
  std::filesystem::create_directories(dir, ec);
  const std::string path = (dir / std::to_string(port)).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return true;  // no lock directory: fall back to the bind check alone
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);  // claimed by another process (or earlier in this one)
    return false;
  }
  held.push_back(fd);
  return true;
}

/// A TCP port that was free a moment ago (the config needs fixed ports; ports of one test
/// are distinct, and no other test process that uses this header gets it: claim_port).
/// Chosen below the kernel's ephemeral range: a port bind(0) hands out there can be taken,
/// before the node listens on it, as the source port of some outgoing connection (the
/// parallel suite opens thousands), and the node then fails to start.
inline uint16_t free_tcp_port(std::set<uint16_t>& taken) {
  int lo = 32768, hi = 60999;
  if (std::ifstream r("/proc/sys/net/ipv4/ip_local_port_range"); r) r >> lo >> hi;
  static std::mt19937 rng(std::random_device{}());
  const bool below = lo > 12000;
  std::uniform_int_distribution<int> pick(10000, below ? lo - 1 : 10000);
  for (int attempt = 0; attempt < 200; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = below ? htons(static_cast<uint16_t>(pick(rng))) : 0;
    socklen_t len = sizeof a;
    uint16_t port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    ::close(fd);
    if (port != 0 && !taken.count(port) && claim_port(port)) {
      taken.insert(port);
      return port;
    }
  }
  throw std::runtime_error("no free port");
}

}  // namespace tandem::e2e
