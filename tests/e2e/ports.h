#pragma once
/// Fixed TCP ports for the nodes a test starts (their configs need them up front).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <random>
#include <set>
#include <stdexcept>

namespace tandem::e2e {

/// A TCP port that was free a moment ago (the config needs fixed ports; ports of one test
/// are distinct). Chosen below the kernel's ephemeral range: a port bind(0) hands out there
/// can be taken, before the node listens on it, as the source port of some outgoing
/// connection (the parallel suite opens thousands), and the node then fails to start.
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
    if (port != 0 && taken.insert(port).second) return port;
  }
  throw std::runtime_error("no free port");
}

}  // namespace tandem::e2e
