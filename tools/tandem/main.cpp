// Entry point: dispatches to a subcommand. `main` is the only place that wires things.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/exit_codes.h"

namespace {

void usage() {
  std::fputs(
      "usage: tandem <command> [options]\n"
      "\n"
      "commands:\n"
      "  serve         run a node; without --config, an embedded single-process cluster\n"
      "  check-config  validate a cluster config and exit (0 valid, 78 invalid)\n"
      "  inspect       list the actors, requests and KV pools of a running node\n"
      "  bench         benchmarks: model | control-plane | transfer | cache | serve\n"
      "  make-model    write a random-weight Llama GGUF (--preset tiny-15m|small-110m)\n"
      "  generate      stream a completion from a running node over Cap'n Proto RPC\n"
      "  tokenize      print the token ids of the text on stdin (--model FILE)\n"
      "\n"
      "run 'tandem <command> --help' for the options of a command\n"
      "\n"
      "exit codes (docs/operations.md, \"Exit codes\"):\n"
      "  0   success\n"
      "  1   runtime failure (e.g. a node whose supervisor gave up); a process manager may restart it\n"
      "  64  usage error (EX_USAGE): unknown command or flag, bad or conflicting flag values\n"
      "  78  config error (EX_CONFIG): invalid or unreadable config, unknown --node, unusable model file;\n"
      "      restarting cannot help (deploy/systemd units do not restart on 64 or 78)\n",
      stderr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage();
    return tandem::cli::exit_usage;
  }
  std::string cmd = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
  try {
    if (cmd == "serve") return tandem::cli::serve(rest);
    if (cmd == "check-config") return tandem::cli::check_config(rest);
    if (cmd == "inspect") return tandem::cli::inspect(rest);
    if (cmd == "bench") return tandem::cli::bench(rest);
    if (cmd == "make-model") return tandem::cli::make_model(rest);
    if (cmd == "generate") return tandem::cli::generate(rest);
    if (cmd == "tokenize") return tandem::cli::tokenize(rest);
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      usage();
      return 0;
    }
    std::fprintf(stderr, "tandem: unknown command '%s'\n", cmd.c_str());
    usage();
    return tandem::cli::exit_usage;
  } catch (const tandem::cli::usage_error& e) {
    std::fprintf(stderr, "tandem %s: usage error: %s\n", cmd.c_str(), e.what());
    return tandem::cli::exit_usage;
  } catch (const tandem::cli::config_error& e) {
    std::fprintf(stderr, "tandem %s: config error: %s\n", cmd.c_str(), e.what());
    return tandem::cli::exit_config;
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem %s: error (%s): %s\n", cmd.c_str(),
                 std::string(tandem::to_string(e.kind())).c_str(), e.what());
    return tandem::cli::exit_failure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem %s: error: %s\n", cmd.c_str(), e.what());
    return tandem::cli::exit_failure;
  }
}
