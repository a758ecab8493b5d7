// The cluster config: the TOML subset parser, every check of `tandem check-config` (one table
// row per invalid config with the message it must print), and the CLI's exit codes.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "actors/config/cluster_config.h"
#include "actors/config/toml.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"

using namespace tandem;
namespace fs = std::filesystem;

namespace {

/// A fixed machine so the memory and NUMA checks do not depend on where the tests run.
machine_info test_machine() {
  machine_info m;
  m.mem_total_bytes = 16ull << 30;
  m.mem_available_bytes = 8ull << 30;
  m.numa_node_bytes = {8ull << 30, 8ull << 30};
  m.cpus = 8;
  m.kernel_paths = {"best", "scalar", "avx2", "avx512"};  // no AMX tiles
  return m;
}

const std::string all_roles = R"(roles = ["router", "prefill", "decode", "cache", "worker"])";

/// One node with every role (an embedded cluster), plus `extra` appended.
std::string one_node(const std::string& extra = "", const std::string& limits = "page_size = 16\nkv_cache_mb = 64\n") {
  return "[limits]\n" + limits + "\n[[node]]\nname = \"n0\"\nhost = \"127.0.0.1\"\n" + all_roles +
         "\nhttp_port = 8080\nrpc_port = 8081\nadmin_port = 8082\n" + extra;
}

/// Router, prefill and decode on three hosts.
std::string three_nodes(const std::string& prefill_extra = "", const std::string& decode_extra = "",
                        const std::string& head = "") {
  return head +
         "[[node]]\nname = \"r\"\nhost = \"10.0.0.1\"\nroles = [\"router\"]\ncluster_port = 9000\n"
         "[[node]]\nname = \"p\"\nhost = \"10.0.0.2\"\nroles = [\"prefill\", \"cache\", \"worker\"]\n"
         "cluster_port = 9000\nkv_port = 9001\n" +
         prefill_extra +
         "\n[[node]]\nname = \"d\"\nhost = \"10.0.0.3\"\nroles = [\"decode\", \"cache\", \"worker\"]\n"
         "cluster_port = 9000\n" + decode_extra +
         "\n";
}

std::string joined(const config_check& c) {
  std::string s;
  for (const auto& e : c.errors) s += e + "\n";
  return s;
}

struct invalid_case {
  const char* what;
  std::string text;
  std::string expect;  ///< substring of one of the errors
};

/// A key file with mode 644 (whatever the umask), for the permission check.
std::string world_readable_key_file() {
  auto p = std::filesystem::temp_directory_path() / "tandem-test-config-keys-644";
  std::ofstream(p) << "0123456789abcdef0123456789abcdef\n";
  std::filesystem::permissions(p, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                                      std::filesystem::perms::group_read | std::filesystem::perms::others_read);
  return p.string();
}

std::vector<invalid_case> invalid_cases(const std::string& mp) {
  return {
      // --- syntax
      {"unclosed header", "[limits\npage_size = 16\n", "t.toml:1:8: table header: expected ']'"},
      {"unclosed string", "[model]\npath = \"abc\n", "t.toml:2:12: string: unescaped control characters other than TAB (U+0009) are explicitly prohibited (is the string closed on its line?)"},
      {"duplicate key", "[limits]\npage_size = 16\npage_size = 32\n", "t.toml:3:13: key-value pair: cannot redefine existing integer 'page_size'"},
      {"table twice", "[limits]\n[limits]\n", "cannot redefine existing table 'limits'"},
      {"leading zero", "[limits]\npage_size = 016\n", "leading zeroes are prohibited"},
      {"bare word value", "[router]\npolicy = round_robin\n", "t.toml:2:10: value: could not determine value type (strings need quotes"},
      {"two values on a line", "[limits]\npage_size = 16 32\n", "expected a comment or whitespace, saw '3'"},
      {"array not closed", "[[node]]\nroles = [\"router\",\n", "t.toml:2:20: array: encountered end-of-file"},
      {"bad escape", "[model]\npath = \"a\\qb\"\n", "unknown escape sequence '\\q'"},
      {"date", "[limits]\nmax_context = 1979-05-27\n", "t.toml:2:15: dates and times are not supported in a Tandem config"},
      {"integer overflow", "[limits]\nmax_body_bytes = 99999999999999999999\n", "is not representable in 64 bits"},
      // --- unknown keys, did-you-mean
      {"unknown table", one_node("[limit]\npage_size = 16\n"), "limit: unknown key; did you mean 'limits'?"},
      {"unknown limits key", one_node("", "page_sise = 16\n"), "t.toml:2:1: limits.page_sise: unknown key; did you mean 'page_size'?"},
      {"unknown node key", one_node("http-port = 9000\n"), "node[0].http-port: unknown key; did you mean 'http_port'?"},
      {"unknown cache key", one_node("[cache]\nhost_ration = 2\n"), "cache.host_ration: unknown key; did you mean 'host_ratio'?"},
      {"unknown key, no guess", one_node("[transfer]\ncolour = 1\n"), "transfer.colour: unknown key; [transfer] takes: failure_policy, timeout_ms"},
      // --- types and ranges of [limits] and [model]
      {"quoted integer", one_node("", "page_size = \"16\"\n"), "limits.page_size = \"16\": expected an integer, got a string; remove the quotes"},
      {"page_size 0", one_node("", "page_size = 0\n"), "limits.page_size = 0: out of range 1 .. 4096"},
      {"page_size huge", one_node("", "page_size = 5000\n"), "limits.page_size = 5000: out of range 1 .. 4096"},
      {"negative mailbox", one_node("", "router_mailbox = -1\n"), "limits.router_mailbox = -1: out of range 1 .. 2147483647; set a mailbox bound"},
      {"int32 overflow", one_node("", "max_running_seqs = 3000000000\n"), "limits.max_running_seqs = 3000000000: out of range 1 .. 2147483647"},
      {"queued tokens 0", one_node("", "max_queued_tokens = 0\n"), "limits.max_queued_tokens = 0: out of range (must be >= 1)"},
      {"float for int", one_node("", "kv_cache_mb = 1.5\n"), "limits.kv_cache_mb = 1.5: expected an integer, got a float"},
      {"no KV size", one_node("", "kv_cache_mb = 0\ndevice_pages = 0\n"), "limits.kv_cache_mb = 0 must be > 0 when device_pages is 0"},
      {"bool as int", one_node("", "prefix_cache = 1\n"), "limits.prefix_cache = 1: expected a boolean, got an integer; write prefix_cache = true"},
      {"limits not a table", "limits = 5\n" + three_nodes(), "limits = 5: expected a table, got an integer"},
      {"threads twice", one_node("[model]\nthreads = 4\n", "threads = 2\n"), "model.threads = 4: conflicts with limits.threads = 2"},
      {"model path type", one_node("[model]\npath = 42\n"), "model.path = 42: expected a string, got an integer"},
      {"kernels typo", one_node("[model]\nkernels = \"avx51\"\n"), "model.kernels = \"avx51\": not a known value; did you mean 'avx512'?"},
      {"kernels this machine lacks", one_node("[model]\nkernels = \"amx\"\n"),
       "model.kernels = \"amx\": this machine cannot run the amx kernels; use one of: best, scalar, avx2, avx512"},
      {"kv cache dtype typo", one_node("[model]\nkv_cache_dtype = \"fp16\"\n"),
       "model.kv_cache_dtype = \"fp16\": not a known value; did you mean 'f16'?"},
      {"model path empty", one_node("[model]\npath = \"\"\n"), "model.path = \"\": is empty"},
      {"model not gguf", one_node("[model]\npath = \"" + std::string(TANDEM_SOURCE_DIR) + "/README.md\"\n"), "is not a usable GGUF model"},
      // --- [cache]
      {"negative host_ratio", one_node("[cache]\nhost_ratio = -1\n"), "cache.host_ratio = -1: out of range 0 .. 1024"},
      {"ratio and size", one_node("[cache]\nhost_ratio = 2\nhost_size_gb = 1\n"), "cache.host_size_gb = 1: is exclusive with cache.host_ratio = 2"},
      {"write policy typo", one_node("[cache]\nwrite_policy = \"write_thru\"\n"), "did you mean 'write_through'?"},
      {"threshold 0", one_node("[cache]\nwrite_through_threshold = 0\n"), "cache.write_through_threshold = 0: out of range"},
      {"disk dir unbounded", one_node("[cache]\ndisk_dir = \"/tmp/kv\"\n"), "cache.disk_dir = \"/tmp/kv\": needs cache.disk_size_gb"},
      {"disk size 0 with dir", one_node("[cache]\ndisk_dir = \"/tmp/kv\"\ndisk_size_gb = 0\n"), "cache.disk_size_gb = 0: must be > 0 when cache.disk_dir is set"},
      {"disk size without dir", one_node("[cache]\ndisk_size_gb = 10\n"), "cache.disk_size_gb = 10: has no effect without cache.disk_dir"},
      {"tiers while disabled", one_node("[cache]\nenabled = false\nhost_ratio = 2\n"), "cache.enabled = false: turns prefix reuse off"},
      {"min load back negative", one_node("[cache]\nmin_load_back_tokens = -3\n"), "cache.min_load_back_tokens = -3: out of range"},
      {"disk dir is a file", one_node("[cache]\ndisk_dir = \"" + std::string(TANDEM_SOURCE_DIR) + "/README.md\"\ndisk_size_gb = 1\n"), "/README.md\": is not a directory"},
      {"disk tier beyond its disk", one_node("[cache]\ndisk_dir = \"/tmp\"\ndisk_size_gb = 10000000\n"), "cache.disk_size_gb = 10000000: the filesystem of cache.disk_dir = \"/tmp\" holds only"},
      // --- [router], [transfer]
      {"router policy typo", one_node("[router]\npolicy = \"roundrobin\"\n"), "router.policy = \"roundrobin\": not a known value; did you mean 'round_robin'?"},
      {"failure policy", one_node("[transfer]\nfailure_policy = \"retry\"\n"), "transfer.failure_policy = \"retry\": not a known value; use one of: recompute, fail"},
      {"transfer timeout 0", one_node("[transfer]\ntimeout_ms = 0\n"), "transfer.timeout_ms = 0: out of range 1 .. 3600000"},
      // --- [security]
      {"api key file missing", one_node("[security]\napi_key_file = \"/nonexistent/keys\"\n"), "security.api_key_file = \"/nonexistent/keys\": No such file or directory; create it with one key per line"},
      {"api key file readable by others", one_node("[security]\napi_key_file = \"" + world_readable_key_file() + "\"\n"), "is accessible by group or others (mode 644); run `chmod 600"},
      {"api key file empty path", one_node("[security]\napi_key_file = \"\"\n"), "security.api_key_file = \"\": is empty"},
      {"allowlist not absolute", one_node("[security]\nauth_allowlist = [\"health\"]\n"), "expected an array of absolute paths; write auth_allowlist = [\"/health\"]"},
      {"allowlist not an array", one_node("[security]\nauth_allowlist = \"/health\"\n"), "security.auth_allowlist = \"/health\": expected an array of absolute paths"},
      {"unknown security key", one_node("[security]\napi_key_fil = \"k\"\n"), "security.api_key_fil: unknown key; did you mean 'api_key_file'?"},
      // --- nodes and roles
      {"no nodes", "[limits]\npage_size = 16\n", "node: no [[node]] entries"},
      {"node single brackets", "[node]\nname = \"a\"\n", "node: is a table, not an array of tables; write each node as [[node]]"},
      {"node without name", "[[node]]\n" + all_roles + "\n", "node[0].name: is missing"},
      {"node without roles", "[[node]]\nname = \"a\"\n", "node[0].roles: is missing"},
      {"duplicate node names", three_nodes("", "", "").replace(three_nodes().find("name = \"d\""), 10, "name = \"p\""), "node[2].name = \"p\": is used by another node"},
      {"bad node name", one_node().replace(one_node().find("\"n0\""), 4, "\"a b\""), "node[0].name = \"a b\": is not a node name"},
      {"role typo", three_nodes("", "").replace(three_nodes().find("\"decode\""), 8, "\"decoder\""), "node[2].roles = \"decoder\": unknown role; did you mean 'decode'?"},
      {"role twice", "[[node]]\nname = \"a\"\nroles = [\"router\", \"router\", \"prefill\", \"decode\", \"cache\", \"worker\"]\n", "node[0].roles = \"router\": is listed twice"},
      {"roles not array", "[[node]]\nname = \"a\"\nroles = \"router\"\n", "node[0].roles = \"router\": expected an array of strings, got a string"},
      {"roles empty", "[[node]]\nname = \"a\"\nroles = []\n", "node[0].roles = []: is empty"},
      {"no router", three_nodes().replace(three_nodes().find("[\"router\"]"), 10, "[]"), "no node has the role \"router\""},
      {"two routers", three_nodes("", "", "[[node]]\nname = \"r2\"\nhost = \"10.0.0.9\"\nroles = [\"router\"]\n"), "2 nodes have the role \"router\" ('r2', 'r')"},
      {"no prefill", "[[node]]\nname = \"a\"\nroles = [\"router\", \"decode\", \"cache\", \"worker\"]\n", "no node has the role \"prefill\""},
      {"no decode", "[[node]]\nname = \"a\"\nroles = [\"router\", \"prefill\", \"cache\", \"worker\"]\n", "no node has the role \"decode\""},
      {"scheduler without worker", three_nodes().replace(three_nodes().find("\"cache\", \"worker\"]"), 18, "\"cache\"]"), "node 'p' runs a scheduler but no worker"},
      {"worker without scheduler", three_nodes().replace(three_nodes().find("[\"router\"]"), 10, "[\"router\", \"worker\"]"), "node 'r' has a worker but no prefill or decode"},
      // --- ports, NUMA, page sizes
      {"port twice on a node", one_node().replace(one_node().find("rpc_port = 8081"), 15, "rpc_port = 8080"), "node[0].rpc_port = 8080: port 8080 on host 127.0.0.1 is already taken by node[0] ('n0').http_port"},
      {"port twice on a host", one_node("[[node]]\nname = \"x\"\nhost = \"localhost\"\nroles = [\"decode\", \"cache\", \"worker\"]\nhttp_port = 9000\nrpc_port = 8081\nadmin_port = 9002\n"),
       "node[1].rpc_port = 8081: port 8081 on host localhost is already taken by node[0] ('n0').rpc_port"},
      {"port out of range", one_node().replace(one_node().find("8082"), 4, "70000"), "node[0].admin_port = 70000: out of range 0 .. 65535"},
      {"no cluster_port in multi-node", three_nodes().replace(three_nodes().find("cluster_port = 9000\nkv_port"), 20, ""),
       "node[1].cluster_port: node 'p' has no cluster_port: in a cluster of 3 nodes"},
      {"no kv_port on a prefill node", three_nodes().replace(three_nodes().find("kv_port = 9001\n"), 15, ""),
       "node[1].kv_port: prefill node 'p' has no kv_port"},
      {"cluster_port out of range", three_nodes("", "cluster_port = 0\n").replace(three_nodes().rfind("cluster_port = 9000\n"), 20, ""),
       "node[2].cluster_port = 0: out of range 1 .. 65535"},
      {"kv_port collides on a host", three_nodes("http_port = 9001\n"),
       "port 9001 on host 10.0.0.2 is already taken by node[1] ('p').http_port"},
      {"port 0 in multi-node", three_nodes("http_port = 0\n"), "node[1].http_port = 0: 0 (any free port) only works for a single-node cluster"},
      {"numa node absent", one_node("numa_node = 5\n"), "node[0].numa_node = 5: this machine has NUMA nodes 0..1"},
      {"page sizes differ", three_nodes("page_size = 16\n", "page_size = 32\n"), "node[2].page_size = 32: node 'd' uses 32 tokens per page but node 'p' uses 16"},
      // --- memory and the model's KV layout
      {"host tier over RAM", one_node("[cache]\nhost_size_gb = 100\n"), "the KV pools of the nodes on this machine need 100.06 GiB ('n0' 100.06 GiB) but it has 16.00 GiB of RAM"},
      {"host tier over NUMA node", one_node("numa_node = 1\n[cache]\nhost_size_gb = 10\n"), "the KV pools pinned to NUMA node 1 need 10.06 GiB but that node has 8.00 GiB"},
      {"KV smaller than a page", one_node("[model]\npath = \"" + mp + "\"\n", "page_size = 4096\nkv_cache_mb = 1\n"), "limits.kv_cache_mb = 1: holds no page of node 'n0'"},
      {"context beyond the model", one_node("[model]\npath = \"" + mp + "\"\n", "max_context = 100000000\n"), "limits.max_context = 100000000: the model's context is"},
      // --- the cache tier's checks against the model's KV layout (validate_cache_config)
      {"host size below one page of this layout", one_node("[model]\npath = \"" + mp + "\"\n[cache]\nhost_size_gb = 0.000001\n"),
       "cache.host_size_gb = 1e-06 is not supported for this model's KV layout"},
      {"host size below one page names the alternative", one_node("[model]\npath = \"" + mp + "\"\n[cache]\nhost_size_gb = 0.000001\n"),
       "use cache.host_ratio"},
      {"disk tier without a host tier", one_node("[model]\npath = \"" + mp + "\"\n[cache]\ndisk_dir = \"/tmp\"\ndisk_size_gb = 1\n"),
       "cache.disk_dir = '/tmp' needs a host tier"},
  };
}

}  // namespace

TEST_CASE("toml: tables, arrays of tables, strings, numbers, booleans, arrays") {
  auto v = toml::parse(R"(# a comment
title = "T\u00e9st \"q\"\t"   # trailing comment
lit = 'C:\path'
n = -1_000
h = 0xff
f = 2.5e3
b = true
arr = [ 1, 2,
  3, # inside
]
nested = [[1], ["a", 'b']]
[a.b]
x = 1
[[node]]
name = "first"
[node.extra]
y = 2
[[node]]
name = "second"
[node.extra]
y = 3
)");
  CHECK(v.find("title")->str == "T\xc3\xa9st \"q\"\t");
  CHECK(v.find("lit")->str == "C:\\path");
  CHECK(v.find("n")->integer == -1000);
  CHECK(v.find("h")->integer == 255);
  CHECK(v.find("f")->floating == 2500.0);
  CHECK(v.find("b")->boolean);
  REQUIRE(v.find("arr")->items.size() == 3);
  CHECK(v.find("arr")->items[2].integer == 3);
  CHECK(v.find("nested")->items[1].items[1].str == "b");
  CHECK(v.find("a")->find("b")->find("x")->integer == 1);
  const auto* nodes = v.find("node");
  REQUIRE(nodes->items.size() == 2);
  CHECK(nodes->items[0].find("extra")->find("y")->integer == 2);
  CHECK(nodes->items[1].find("name")->str == "second");
  CHECK(nodes->items[1].find("extra")->find("y")->integer == 3);
  CHECK(v.find("b")->pos.line == 7);
  CHECK(v.find("b")->pos.column == 5);
}

TEST_CASE("toml: inline tables and dotted keys mean the tables they spell, keys in file order") {
  auto a = toml::parse("limits = { page_size = 16, kv_cache_mb = 64 }\nrouter.policy = \"round_robin\"\n");
  auto b = toml::parse("[limits]\npage_size = 16\nkv_cache_mb = 64\n[router]\npolicy = \"round_robin\"\n");
  for (const auto* v : {&a, &b}) {
    CHECK(v->find("limits")->find("page_size")->integer == 16);
    CHECK(v->find("limits")->find("kv_cache_mb")->integer == 64);
    CHECK(v->find("router")->find("policy")->str == "round_robin");
  }
  // toml++ sorts keys; the converter gives them back in the order the file has them.
  auto z = toml::parse("zeta = 1\nalpha = 2\nmid = 3\n");
  REQUIRE(z.entries.size() == 3);
  CHECK(z.entries[0].key == "zeta");
  CHECK(z.entries[1].key == "alpha");
  CHECK(z.entries[2].key_pos.line == 3);
  CHECK(z.entries[2].key_pos.column == 1);
  CHECK_THROWS_WITH_AS(toml::parse("t = 07:32:00\n", "x"), doctest::Contains("x:1:5: dates and times"), toml::parse_error);
  CHECK_THROWS_WITH_AS(toml::parse("s = \"a\xff\"\n", "x"), doctest::Contains("x:1:"), toml::parse_error);
}

TEST_CASE("toml: an array-of-tables name cannot be reused as a table or a plain array") {
  CHECK_THROWS_WITH_AS(toml::parse("[[node]]\n[node]\n", "x"), doctest::Contains("x:2:1: table header: cannot redefine existing array 'node' as table"), toml::parse_error);
  CHECK_THROWS_WITH_AS(toml::parse("node = [1]\n[[node]]\n", "x"), doctest::Contains("cannot redefine existing array 'node' as array-of-tables"),
                       toml::parse_error);
  CHECK_THROWS_WITH_AS(toml::parse("a = 1\n[a.b]\n", "x"), doctest::Contains("cannot redefine existing integer 'a.b' as table"), toml::parse_error);
}

TEST_CASE("check: did-you-mean picks the closest key within a typo's distance") {
  CHECK(edit_distance("kitten", "sitting") == 3);
  CHECK(did_you_mean("page_sise", {"page_size", "kv_cache_mb"}) == "page_size");
  CHECK(did_you_mean("zzzzzz", {"page_size", "kv_cache_mb"}).empty());
}

TEST_CASE("check: valid configs pass and fill the config") {
  auto m = test_machine();
  e2e::temp_dir dir;
  std::string model = e2e::write_micro_model(dir.path);
  SUBCASE("one node with every role") {
    auto c = check_cluster_config(
        one_node("[model]\nthreads = 3\nkernels = \"avx2\"\n[router]\npolicy = \"cache_aware\"\n"), "t.toml", m);
    INFO(joined(c));
    REQUIRE(c.ok());
    REQUIRE(c.cfg.nodes.size() == 1);
    CHECK(c.cfg.nodes[0].all_roles());
    CHECK(c.cfg.lim.threads == 3);
    CHECK(c.cfg.kernel_isa == "avx2");
    CHECK(c.cfg.kv_cache_dtype == "f32");
    CHECK(c.cfg.lim.kv_cache_mb == 64);
    CHECK(c.cfg.router_policy == "cache_aware");
  }
  SUBCASE("three nodes, cache tiers, transfer settings") {
    auto c = check_cluster_config(three_nodes("numa_node = 0\n", "", "[cache]\nhost_ratio = 2.5\nwrite_policy = \"write_back\"\n"
                                                                   "disk_dir = \"/var/tmp/kv\"\ndisk_size_gb = 50\n"
                                                                   "[transfer]\nfailure_policy = \"fail\"\ntimeout_ms = 500\n"),
                                  "t.toml", m);
    INFO(joined(c));
    REQUIRE(c.ok());
    CHECK(c.cfg.nodes.size() == 3);
    CHECK(c.cfg.cache.host_ratio == 2.5);
    CHECK(c.cfg.cache.write_policy == cache_write_policy::write_back);
    CHECK(c.cfg.transfer_failure_policy == kv_failure_policy::fail);
    CHECK(c.cfg.transfer_timeout_ms == 500);
    CHECK(c.cfg.find_node("d")->has_role("decode"));
  }
  SUBCASE("with the model: its KV layout fits") {
    auto c = check_cluster_config(one_node("[model]\npath = \"" + model + "\"\n"), "t.toml", m);
    INFO(joined(c));
    CHECK(c.ok());
    CHECK(c.notes.empty());
  }
  SUBCASE("with the model: an f16 KV cache halves the bytes of a page") {
    // The micro model caches 512 bytes per position in f32: a 4096-position page is 2 MiB,
    // which 1 MiB cannot hold; in f16 it is 1 MiB.
    const std::string limits = "page_size = 4096\nkv_cache_mb = 1\n";
    auto f32 = check_cluster_config(one_node("[model]\npath = \"" + model + "\"\n", limits), "t.toml", m);
    CHECK(joined(f32).find("limits.kv_cache_mb = 1: holds no page of node 'n0' (2097152 bytes per page") !=
          std::string::npos);
    auto f16 = check_cluster_config(
        one_node("[model]\npath = \"" + model + "\"\nkv_cache_dtype = \"f16\"\n", limits), "t.toml", m);
    INFO(joined(f16));
    CHECK(joined(f16).find("holds no page") == std::string::npos);
    CHECK(f16.ok());
    CHECK(f16.cfg.kv_cache_dtype == "f16");
  }
  SUBCASE("a model path on another machine is a note, not an error") {
    std::string remote = one_node("[model]\npath = \"/nonexistent/model.gguf\"\n");
    remote.replace(remote.find("127.0.0.1"), 9, "10.9.9.9");
    auto c = check_cluster_config(remote, "t.toml", m);
    CHECK(c.ok());
    REQUIRE(c.notes.size() == 1);
    CHECK(c.notes[0].find("KV layout checks were skipped") != std::string::npos);
  }
  SUBCASE("a missing model file of a node on this machine is an error (serve would fail loading it)") {
    auto c = check_cluster_config(one_node("[model]\npath = \"/nonexistent/model.gguf\"\n"), "t.toml", m);
    CHECK_FALSE(c.ok());
    CHECK(joined(c).find("model.path = \"/nonexistent/model.gguf\": no such file; node 'n0' runs on this "
                         "machine and loads it: copy the model here or fix the path") != std::string::npos);
    // The node named by --node is on this machine whatever its host says.
    std::string remote = one_node("[model]\npath = \"/nonexistent/model.gguf\"\n");
    remote.replace(remote.find("127.0.0.1"), 9, "10.9.9.9");
    machine_info here = m;
    here.node = "n0";
    CHECK_FALSE(check_cluster_config(remote, "t.toml", here).ok());
    here.node = "zz";
    CHECK(joined(check_cluster_config(remote, "t.toml", here)).find("there is no node 'zz' (--node); use one of: n0") !=
          std::string::npos);
  }
  SUBCASE("an unreadable model file is an error") {
    e2e::temp_dir d;
    fs::copy_file(model, d.path / "m.gguf");
    fs::permissions(d.path / "m.gguf", fs::perms::none);
    std::ifstream probe(d.path / "m.gguf");
    if (!probe) {  // root reads it anyway
      auto c = check_cluster_config(one_node("[model]\npath = \"" + (d.path / "m.gguf").string() + "\"\n"), "t.toml", m);
      CHECK_FALSE(c.ok());
      CHECK(joined(c).find("is not a usable GGUF model") != std::string::npos);
    }
    fs::permissions(d.path / "m.gguf", fs::perms::owner_all);
  }
}

TEST_CASE("check: every invalid config is rejected with its message") {
  auto m = test_machine();
  e2e::temp_dir dir;
  auto cases = invalid_cases(e2e::write_micro_model(dir.path));
  CHECK(cases.size() >= 30);
  for (const auto& c : cases) {
    auto r = check_cluster_config(c.text, "t.toml", m);
    INFO("case: " << std::string(c.what) << "\nconfig:\n" << c.text << "\nerrors:\n" << joined(r));
    CHECK_FALSE(r.ok());
    CHECK(joined(r).find(c.expect) != std::string::npos);
  }
}

TEST_CASE("check: all problems are reported at once, each with its line") {
  auto r = check_cluster_config("[limits]\npage_size = 0\nrouter_mailbox = \"x\"\n[router]\npolicy = \"best\"\n", "t.toml",
                                test_machine());
  INFO(joined(r));
  CHECK(r.errors.size() == 4);  // page_size, router_mailbox, router.policy, no nodes
  CHECK(joined(r).find("t.toml:2:13: limits.page_size = 0") != std::string::npos);
  CHECK(joined(r).find("t.toml:3:18: limits.router_mailbox = \"x\"") != std::string::npos);
  CHECK(joined(r).find("t.toml:5:10: router.policy = \"best\"") != std::string::npos);
}

TEST_CASE("check: kernels = amx counts its copy of the weights against the machine's memory") {
  e2e::temp_dir dir;
  const std::string model = e2e::write_micro_model(dir.path);
  machine_info m = test_machine();
  m.kernel_paths.push_back("amx");
  // Room for the 64 MiB KV pool (no host tier) and 1 KiB more: enough for the avx512 path,
  // not for the amx copy of the micro model's f16 matrices (at least 1 KiB each).
  m.mem_total_bytes = (64ull << 20) + 1024;
  const std::string model_table = "[model]\npath = \"" + model + "\"\n";
  auto fits = check_cluster_config(one_node(model_table), "t.toml", m);
  INFO(joined(fits));
  CHECK(fits.ok());
  auto c = check_cluster_config(one_node(model_table + "kernels = \"amx\"\n"), "t.toml", m);
  INFO(joined(c));
  CHECK(!c.ok());
  CHECK(joined(c).find("'n0' amx weight copy") != std::string::npos);
  CHECK(joined(c).find("or drop model.kernels = \"amx\" (it copies the weights)") != std::string::npos);
}

TEST_CASE("check: a worker's packed copy of the low-bit weights counts against the machine's memory") {
  e2e::temp_dir dir;
  make_model_options o;
  o.preset = "micro";
  o.dtype = ggml_type::q4_0;
  o.seed = 7;
  const std::string model = (dir.path / "micro-q4_0.gguf").string();
  write_random_llama(o, model);
  machine_info m = test_machine();
  // Room for the 64 MiB KV pool and 1 KiB more: not for the packed copy of the micro model's
  // q4_0 matrices (each padded to whole 16-row groups, more than 1 KiB).
  m.mem_total_bytes = (64ull << 20) + 1024;
  const std::string model_table = "[model]\npath = \"" + model + "\"\n";
  auto fits = check_cluster_config(one_node(model_table), "t.toml", m);
  INFO(joined(fits));
  CHECK(fits.ok());
  m.packs_low_bit = true;
  auto c = check_cluster_config(one_node(model_table), "t.toml", m);
  INFO(joined(c));
  CHECK(!c.ok());
  CHECK(joined(c).find("'n0' packed low-bit weight copy") != std::string::npos);
  CHECK(joined(c).find("or run with TANDEM_PACK=0") != std::string::npos);
  // The avx2 path runs the row-major kernels: no copy.
  auto avx2 = check_cluster_config(one_node(model_table + "kernels = \"avx2\"\n"), "t.toml", m);
  INFO(joined(avx2));
  CHECK(avx2.ok());
  // Unpacked, the weights are copied out of the file's mapping instead (as big again, less
  // the groups' padding): counted, and TANDEM_COPY_WEIGHTS=0 named.
  m.copies_weights = true;
  auto copied = check_cluster_config(one_node(model_table + "kernels = \"avx2\"\n"), "t.toml", m);
  INFO(joined(copied));
  CHECK(!copied.ok());
  CHECK(joined(copied).find("'n0' in-memory weight copy") != std::string::npos);
  CHECK(joined(copied).find("or run with TANDEM_COPY_WEIGHTS=0") != std::string::npos);
  CHECK(joined(copied).find("TANDEM_PACK=0") == std::string::npos);
  // Packed, nothing is left to copy as it is (every matrix of the micro model is q4_0).
  auto packed = check_cluster_config(one_node(model_table), "t.toml", m);
  CHECK(joined(packed).find("in-memory weight copy") == std::string::npos);
}

TEST_CASE("check: the machine probe reads this host's memory") {
  auto m = machine_info::probe();
  CHECK(m.mem_total_bytes > 0);
  CHECK(m.mem_available_bytes <= m.mem_total_bytes);
  // Every machine runs the portable kernels and resolves best.
  REQUIRE(m.kernel_paths.size() >= 2);
  CHECK(m.kernel_paths[0] == "best");
  CHECK(m.kernel_paths[1] == "scalar");
}

namespace {

struct cli_result {
  int code = -1;
  std::string out, err;
};

cli_result run_tandem(const std::vector<std::string>& args, const fs::path& dir) {
  std::vector<std::string> argv = {TANDEM_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string err_path = (dir / "stderr.txt").string();
  cli_result r;
  {
    e2e::child p(argv, {}, err_path);
    r.out = p.read_all(std::chrono::seconds(30));
    r.code = p.wait(std::chrono::seconds(30));
  }
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  return r;
}

void write_file(const fs::path& p, const std::string& s) { std::ofstream(p) << s; }

}  // namespace

TEST_CASE("cli: check-config exits 0 valid, 78 invalid or unreadable, 64 usage, serve --config refuses the same") {
  e2e::temp_dir dir;
  write_file(dir.path / "ok.toml", one_node());
  write_file(dir.path / "bad.toml", one_node("", "page_size = 0\n"));
  write_file(dir.path / "part.toml", three_nodes());

  auto ok = run_tandem({"check-config", (dir.path / "ok.toml").string()}, dir.path);
  CHECK(ok.code == 0);
  CHECK(ok.out.find("ok (1 node: n0)") != std::string::npos);

  auto bad = run_tandem({"check-config", (dir.path / "bad.toml").string()}, dir.path);
  CHECK(bad.code == 78);
  CHECK(bad.err.find("limits.page_size = 0: out of range 1 .. 4096") != std::string::npos);

  CHECK(run_tandem({"check-config", (dir.path / "missing.toml").string()}, dir.path).code == 78);
  CHECK(run_tandem({"check-config"}, dir.path).code == 64);
  CHECK(run_tandem({"check-config", "--bogus", "x"}, dir.path).code == 64);

  auto serve_bad = run_tandem({"serve", "--config", (dir.path / "bad.toml").string(), "--node", "n0"}, dir.path);
  CHECK(serve_bad.code == 78);
  CHECK(serve_bad.err.find("limits.page_size = 0: out of range 1 .. 4096") != std::string::npos);
  CHECK(serve_bad.err.find("the node was not started") != std::string::npos);

  auto part = run_tandem({"serve", "--config", (dir.path / "part.toml").string(), "--node", "p"}, dir.path);
  CHECK(part.code == 78);
  // A node with some roles starts (tests/e2e/test_pd.cpp); this config has no model.
  CHECK(part.err.find("model.path: is not set, and node 'p' needs it") != std::string::npos);

  auto unknown = run_tandem({"serve", "--config", (dir.path / "ok.toml").string(), "--node", "zz"}, dir.path);
  CHECK(unknown.code == 78);
  CHECK(unknown.err.find("use one of: n0") != std::string::npos);

  // Usage errors: 64 (EX_USAGE), distinct from config errors and crashes.
  CHECK(run_tandem({"serve", "--bogus"}, dir.path).code == 64);
  CHECK(run_tandem({"serve", "--config", (dir.path / "ok.toml").string()}, dir.path).code == 64);
  CHECK(run_tandem({"no-such-command"}, dir.path).code == 64);
  auto help = run_tandem({"--help"}, dir.path);
  CHECK(help.err.find("78  config error (EX_CONFIG)") != std::string::npos);

  // A missing model file: check-config refuses it (78) instead of a note, as serve would fail.
  write_file(dir.path / "nomodel.toml", one_node("[model]\npath = \"" + (dir.path / "none.gguf").string() + "\"\n"));
  auto nomodel = run_tandem({"check-config", (dir.path / "nomodel.toml").string()}, dir.path);
  CHECK(nomodel.code == 78);
  CHECK(nomodel.err.find("none.gguf\": no such file; node 'n0' runs on this machine") != std::string::npos);
}

TEST_CASE("cli: serve --config runs the embedded cluster with the config's limits") {
  e2e::temp_dir dir;
  std::string model = e2e::write_micro_model(dir.path);
  std::string cfg = "[limits]\nmax_body_bytes = 64\nkv_cache_mb = 16\n[model]\npath = \"" + model +
                    "\"\nkv_cache_dtype = \"f16\"\n[[node]]\nname = \"solo\"\n" + all_roles +
                    "\nhttp_port = 0\nrpc_port = 0\nadmin_port = 0\n";
  write_file(dir.path / "solo.toml", cfg);
  std::string log = (dir.path / "serve.log").string();
  e2e::child p({TANDEM_BINARY, "serve", "--config", (dir.path / "solo.toml").string(), "--node", "solo", "--log-level", "info"},
               {}, log);
  uint16_t http = 0;
  std::regex re(R"(^tandem: (http|rpc) listening on 127\.0\.0\.1:(\d+)$)");
  for (int i = 0; i < 2; ++i) {
    auto line = p.read_line(std::chrono::seconds(30));
    REQUIRE(line);
    std::smatch mm;
    REQUIRE(std::regex_match(*line, mm, re));
    if (mm[1] == "http") http = static_cast<uint16_t>(std::stoi(mm[2]));
  }
  REQUIRE(http != 0);
  // limits.max_body_bytes = 64 from the file: a larger body is refused.
  auto r = test::post(http, "/v1/completions", std::string(200, ' '));
  CHECK(r.status == 413);
  CHECK(r.body.find("the limit is 64 bytes") != std::string::npos);
  // model.kv_cache_dtype = "f16" from the file: the pool's pages hold halves.
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str().find("page_size=16 kv=f16") != std::string::npos);
}

namespace {

/// An example config of deploy/ with its `path = "model.gguf"` pointed at a micro model, so
/// the check runs in full (a node on this machine whose model is missing is an error).
config_check check_example(const std::string& name, const fs::path& dir) {
  std::ifstream in(std::string(TANDEM_SOURCE_DIR) + "/deploy/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const std::string from = "path = \"model.gguf\"";
  REQUIRE(text.find(from) != std::string::npos);
  text.replace(text.find(from), from.size(), "path = \"" + e2e::write_micro_model(dir) + "\"");
  return check_cluster_config(text, name, test_machine());
}

}  // namespace

TEST_CASE("check: the example config in deploy/ is valid") {
  e2e::temp_dir dir;
  auto c = check_example("cluster.example.toml", dir.path);
  INFO(joined(c));
  CHECK(c.ok());
  CHECK(c.cfg.find_node("solo") != nullptr);
}

TEST_CASE("check: the PD example config in deploy/ is valid and spreads the roles over three nodes") {
  e2e::temp_dir dir;
  auto c = check_example("cluster.pd.example.toml", dir.path);
  INFO(joined(c));
  CHECK(c.ok());
  REQUIRE(c.cfg.nodes.size() == 3);
  CHECK(c.cfg.nodes_with_role("router").size() == 1);
  REQUIRE(c.cfg.nodes_with_role("prefill").size() == 1);
  CHECK(c.cfg.nodes_with_role("prefill")[0]->kv_port > 0);
  for (const auto& n : c.cfg.nodes) CHECK(n.cluster_port > 0);
}
