#pragma once
/// Which network interface UCX may use: the one that holds the node's configured address, so a
/// node on 127.0.0.1 does not also listen on the machine's external interface (UCX's tcp
/// transport opens a listening socket on every device it is given).
#include <string>
#include <vector>

namespace tandem::ucx {

/// One interface address (getifaddrs), for tests and the lookup below.
struct if_address {
  std::string name;  ///< "lo", "eth0"
  std::string ipv4;  ///< dotted quad
};

/// The IPv4 addresses of this machine's interfaces (getifaddrs).
std::vector<if_address> interface_addresses();

/// The UCX_NET_DEVICES value for a node configured with `host`: the interface holding that
/// address among `interfaces` ("lo" for any 127.0.0.0/8 address). Empty when `host` is a
/// wildcard ("", "0.0.0.0": every interface) or no interface holds it (UCX's default then;
/// the caller logs it).
std::string net_devices_for_host(const std::string& host, const std::vector<if_address>& interfaces);

}  // namespace tandem::ucx
