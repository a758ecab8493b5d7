// `tandem serve --threads` defaults to the physical cores this process may run on, counted
// here independently of hwloc: distinct (package, core) pairs of the allowed CPUs in sysfs.
#include <doctest/doctest.h>
#include <sched.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <utility>

#include "actors/common/cpu_cores.h"
#include "tests/e2e/process.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

int sysfs_physical_cores() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  REQUIRE(::sched_getaffinity(0, sizeof allowed, &allowed) == 0);
  std::set<std::pair<int, int>> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream pkg(dir + "physical_package_id"), core(dir + "core_id");
    int p = -1, c = -1;
    pkg >> p;
    core >> c;
    const bool read = pkg && core;
    REQUIRE_MESSAGE(read, "no topology in " << dir);
    cores.emplace(p, c);
  }
  return int(cores.size());
}

}  // namespace

TEST_CASE("serve: --threads defaults to the physical cores (hwloc), as sysfs counts them") {
  const int want = sysfs_physical_cores();
  CHECK(physical_cores() == want);
  // The usage goes to stderr.
  temp_dir tmp;
  const std::string err = (tmp.path / "help.txt").string();
  child help({TANDEM_BINARY, "serve", "--help"}, {}, err);
  help.read_all(std::chrono::seconds(20));
  REQUIRE(help.wait(std::chrono::seconds(10)) == 0);
  std::ifstream in(err);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(text, m, std::regex(R"(--threads VALUE\n[^\n]*\(default: (\d+)\))")),
                  "no --threads default in:\n"
                      << text);
  CHECK(std::stoi(m[1]) == want);
}
