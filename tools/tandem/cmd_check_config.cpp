// tandem check-config FILE: every check `tandem serve --config` runs before it starts anything.
#include <cstdio>

#include "actors/common/error.h"
#include "actors/config/cluster_config.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/config_report.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

void print_config_problems(const config_check& c) {
  for (const auto& e : c.errors) std::fprintf(stderr, "error: %s\n", e.c_str());
  for (const auto& n : c.notes) std::fprintf(stderr, "note: %s\n", n.c_str());
}

int check_config(args a) {
  flags f;
  const char* usage = "usage: tandem check-config FILE\n"
                      "  checks a cluster config (TOML; see docs/config.md) without starting anything.\n"
                      "  exit code: 0 valid, 1 invalid (every problem is printed), 2 usage or I/O error\n";
  try {
    if (!f.parse(a)) {
      std::fputs(usage, stderr);
      return 0;
    }
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem check-config: %s\n%s", e.what(), usage);
    return 2;
  }
  if (f.positional().size() != 1) {
    std::fprintf(stderr, "tandem check-config: expected one config file, got %zu arguments\n%s", f.positional().size(), usage);
    return 2;
  }
  const std::string& path = f.positional()[0];
  config_check c;
  try {
    c = check_cluster_config_file(path, machine_info::probe());
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem check-config: %s\n", e.what());
    return 2;
  }
  print_config_problems(c);
  if (!c.ok()) {
    std::fprintf(stderr, "%s: %zu problem%s; fix %s and check again\n", path.c_str(), c.errors.size(),
                 c.errors.size() == 1 ? "" : "s", c.errors.size() == 1 ? "it" : "them");
    return 1;
  }
  std::string names;
  for (const auto& n : c.cfg.nodes) names += (names.empty() ? "" : ", ") + n.name;
  std::printf("%s: ok (%zu node%s: %s)\n", path.c_str(), c.cfg.nodes.size(), c.cfg.nodes.size() == 1 ? "" : "s",
              names.c_str());
  return 0;
}

}  // namespace tandem::cli
