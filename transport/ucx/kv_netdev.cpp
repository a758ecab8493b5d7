#include "transport/ucx/kv_netdev.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

namespace tandem::ucx {

std::vector<if_address> interface_addresses() {
  std::vector<if_address> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !a->ifa_name) continue;
    char buf[INET_ADDRSTRLEN] = {};
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf)) out.push_back({a->ifa_name, buf});
  }
  freeifaddrs(list);
  return out;
}

std::string net_devices_for_host(const std::string& host, const std::vector<if_address>& interfaces) {
  if (host.empty() || host == "0.0.0.0") return {};
  for (const auto& i : interfaces)
    if (i.ipv4 == host) return i.name;
  // 127.0.0.2 etc. are served by the loopback interface without being listed on it.
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127) return "lo";
  return {};
}

}  // namespace tandem::ucx
