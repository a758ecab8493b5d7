// The hierarchical KV cache: disk file format, settings validation, tier bookkeeping, and the
// cluster with device -> host -> disk tiers (outputs identical to no cache, pages all returned,
// the disk tier found again by a new cluster).
// The cluster cases run on the test scheduler (tests/actors/cluster_rig.h).
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "actors/cache_tier/page_file.h"
#include "actors/cache_tier/radix_cache.h"
#include "actors/common/cache_config.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/support.h"
#include "tests/fake_device.h"

using namespace tandem;
using namespace tandem::test;
namespace fs = std::filesystem;

namespace {

/// A fresh directory removed at scope exit.
struct temp_dir {
  std::string path;
  explicit temp_dir(const std::string& tag) {
    static int n = 0;
    path = (fs::temp_directory_path() /
            ("tandem_cache_" + tag + "_" + std::to_string(getpid()) + "_" + std::to_string(n++)))
               .string();
    fs::remove_all(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  size_t files() const {
    size_t c = 0;
    if (fs::exists(path))
      for (auto& e : fs::directory_iterator(path)) c += e.path().extension() == ".kvp";
    return c;
  }
};

bool contains(const std::vector<std::string>& v, const std::string& a, const std::string& b = "") {
  for (const auto& s : v)
    if (s.find(a) != std::string::npos && s.find(b) != std::string::npos) return true;
  return false;
}


const stats_snapshot* find_actor(const std::vector<stats_snapshot>& v, const std::string& actor) {
  for (const auto& s : v)
    if (s.actor == actor) return &s;
  return nullptr;
}

double tier(const stats_snapshot& s, const std::string& name, const char* t) {
  return s.value(name, std::string("tier=\"") + t + "\"");
}

/// Once the actors are quiet, no request holds a page and no copy is in flight: what is used is
/// exactly what the cache holds.
bool pages_settled(cluster_rig& c) {
  c.run();
  auto v = c.snapshots(false);
  auto* s = find_actor(v, "cache_tier");
  return s && tier(*s, "cache_pages_used", "device") == tier(*s, "cache_pages_cached", "device") &&
         s->value("kv_pages_evictable") == s->value("kv_pages_cached") &&
         tier(*s, "cache_pages_used", "host") == tier(*s, "cache_pages_cached", "host") &&
         s->value("cache_background_copies") == 0;
}

/// A multi-turn workload: `sessions` conversations sharing a system prompt, each turn = history
/// ++ a user message; the reply joins the history. Turns run one at a time, sessions interleaved,
/// so later turns find earlier pages in whatever tier they were pushed to.
struct conversation_run {
  std::vector<std::vector<int32_t>> outputs;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<stats_snapshot> snaps;
};

conversation_run run_conversations(cluster_rig& c, int sessions, int turns, int reply) {
  conversation_run r;
  std::vector<int32_t> system;
  for (int i = 0; i < 10; ++i) system.push_back((i * 7 + 3) % 64);
  std::vector<std::vector<int32_t>> hist(static_cast<size_t>(sessions), system);
  for (int t = 0; t < turns; ++t)
    for (int s = 0; s < sessions; ++s) {
      auto& h = hist[static_cast<size_t>(s)];
      for (int k = 0; k < 6; ++k) h.push_back((s * 13 + t * 5 + k * 3 + 1) % 64);
      collector col;
      auto id = "s" + std::to_string(s) + "t" + std::to_string(t);
      c.submit(make_req(id, h, reply), col.cb());
      REQUIRE(col.wait_finished(1));
      auto last = col.last(id);
      if (last.err) FAIL_CHECK(last.err->what());
      auto out = col.tokens(id);
      r.prompts.push_back(h);
      r.outputs.push_back(out);
      h.insert(h.end(), out.begin(), out.end());
    }
  REQUIRE(pages_settled(c));
  r.snaps = c.snapshots();
  return r;
}

actor_cluster_options tier_opts(const cache_config& cc, int32_t device_pages = 16) {
  actor_cluster_options o;
  o.lim = small_limits();
  o.lim.device_pages = device_pages;
  o.cache = cc;
  o.sink = quiet_sink();
  o.eos_id = -1;
  return o;
}

void check_expected(const conversation_run& r, int reply) {
  REQUIRE(r.outputs.size() == r.prompts.size());
  for (size_t i = 0; i < r.outputs.size(); ++i) CHECK(r.outputs[i] == expected_greedy(r.prompts[i], reply));
}

}  // namespace

TEST_CASE("page_file: CRC32C check value, round trip, corruption and mismatches are misses") {
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  const std::string s = "split across two calls";
  CHECK(crc32c(s.data() + 5, s.size() - 5, crc32c(s.data(), 5)) == crc32c(s.data(), s.size()));
  CHECK(chain_hash(0, std::vector<int32_t>{1, 2}) != chain_hash(0, std::vector<int32_t>{2, 1}));
  CHECK(chain_hash(1, std::vector<int32_t>{1, 2}) != chain_hash(2, std::vector<int32_t>{1, 2}));

  temp_dir d("pf");
  kv_layout L{1, 1, 4, 4};
  const uint64_t fp = L.fingerprint();
  std::vector<uint8_t> payload(L.page_bytes());
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = uint8_t(i * 31 + 7);
  std::vector<int32_t> toks = {5, 6, 7, 8};
  REQUIRE(scan_page_files(d.path, fp, cache_disk_file_bytes(L)).empty());  // creates the directory
  write_page_file(d.path, fp, 42, 7, toks, payload.data(), payload.size());
  auto found = scan_page_files(d.path, fp, cache_disk_file_bytes(L));
  REQUIRE(found.size() == 1);
  CHECK(found[0].hash == 42);
  CHECK(scan_page_files(d.path, fp + 1, cache_disk_file_bytes(L)).empty());  // another layout's files

  std::vector<uint8_t> back(payload.size());
  std::string why;
  REQUIRE(read_page_file(d.path, fp, 42, 7, toks, back.data(), back.size(), why));
  CHECK(back == payload);
  CHECK_FALSE(read_page_file(d.path, fp, 42, 8, toks, back.data(), back.size(), why));  // other parent
  CHECK_FALSE(read_page_file(d.path, fp, 42, 7, std::vector<int32_t>{5, 6, 7, 9}, back.data(), back.size(), why));
  CHECK(why.find("collision") != std::string::npos);
  CHECK_FALSE(read_page_file(d.path, fp, 43, 7, toks, back.data(), back.size(), why));  // missing

  // Flip one payload byte: the checksum catches it.
  auto path = (fs::path(d.path) / page_file_name(fp, 42)).string();
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(path) - 3));
    f.put(char(0x5a));
  }
  CHECK_FALSE(read_page_file(d.path, fp, 42, 7, toks, back.data(), back.size(), why));
  CHECK(why.find("checksum") != std::string::npos);
  remove_page_file(d.path, fp, 42);
  CHECK(d.files() == 0);
}

TEST_CASE("kv_layout: standard K/V unchanged, MLA latent and indexer caches are just components") {
  kv_layout std_l{2, 4, 8, 16};
  CHECK(std_l.is_standard());
  CHECK(std_l.page_bytes() == 2 * 2 * std_l.layer_elems() * sizeof(float));
  kv_pool p(std_l, 3);
  CHECK(p.page_bytes() == std_l.page_bytes());
  CHECK(reinterpret_cast<uint8_t*>(p.v(1, 1)) == p.component(1, 1, 1));
  CHECK(reinterpret_cast<uint8_t*>(p.k(2, 0)) == p.page_data(2));

  kv_layout mla{2, 0, 0, 16, {{"latent", 1, 576, 2}, {"index_k", 1, 128, 1}}};
  CHECK(mla.valid());
  CHECK(mla.layer_bytes() == 16 * 576 * 2 + 16 * 128);
  CHECK(mla.fingerprint() != std_l.fingerprint());
  CHECK(mla.describe().find("latent:1x576x2") != std::string::npos);
  kv_pool mp(mla, 2);
  CHECK(mp.page_bytes() == mla.page_bytes());
  CHECK(mp.component(1, 0, 1) - mp.component(1, 0, 0) == 16 * 576 * 2);
  kv_layout bad{2, 0, 0, 16, {{"latent", 0, 576, 2}}};
  CHECK_FALSE(bad.valid());
}

TEST_CASE("kv_layout: an f16 K/V cache is half the bytes, has its own identity and its own accessors") {
  kv_layout f32_l{2, 4, 8, 16};
  kv_layout f16_l{.n_layers = 2, .n_kv_heads = 4, .head_dim = 8, .page_size = 16, .dtype = kv_dtype::f16};
  CHECK(f16_l.valid());
  CHECK(f16_l.is_standard());
  CHECK(f16_l.page_bytes() * 2 == f32_l.page_bytes());
  CHECK(f16_l.layer_elems() == f32_l.layer_elems());
  CHECK(f16_l.elem_bytes() == 2);
  // Disk-tier files and transfers tell the two apart; an f32 layout keeps its old identity.
  CHECK(f16_l.fingerprint() != f32_l.fingerprint());
  CHECK_FALSE(f16_l == f32_l);
  CHECK(f16_l.describe() == "layers=2 kv_heads=4 head_dim=8 page_size=16 kv=f16");
  CHECK(f32_l.describe() == "layers=2 kv_heads=4 head_dim=8 page_size=16");
  kv_pool p(f16_l, 3);
  CHECK(p.page_bytes() == f16_l.page_bytes());
  CHECK(reinterpret_cast<const uint8_t*>(p.k16(2, 1)) == p.component(2, 1, 0));
  CHECK(reinterpret_cast<const uint8_t*>(p.v16(2, 1)) == p.component(2, 1, 1));
  CHECK(p.v16(0, 0) - p.k16(0, 0) == int64_t(f16_l.layer_elems()));
  // A component list carries its own element sizes: a dtype beside it is ambiguous.
  kv_layout mixed{.n_layers = 2, .page_size = 16, .components = {{"latent", 1, 576, 2}}, .dtype = kv_dtype::f16};
  CHECK_FALSE(mixed.valid());
  kv_dtype t = kv_dtype::f32;
  CHECK(parse_kv_dtype("f16", t));
  CHECK(t == kv_dtype::f16);
  CHECK_FALSE(parse_kv_dtype("fp16", t));
  CHECK(std::string(to_string(kv_dtype::f32)) == "f32");
}

TEST_CASE("cache_config: policies parse, validation names key, value, why and fix") {
  cache_write_policy p;
  for (auto q : {cache_write_policy::write_through, cache_write_policy::write_through_selective,
                 cache_write_policy::write_back}) {
    REQUIRE(parse_cache_write_policy(cache_write_policy_name(q), p));
    CHECK(p == q);
  }
  CHECK_FALSE(parse_cache_write_policy("write_sometimes", p));

  kv_layout L{22, 4, 64, 16};  // 704 KiB pages
  cache_config c;
  CHECK(validate_cache_config(c, L, 1024, 0).empty());
  c.host_ratio = 4;
  CHECK(validate_cache_config(c, L, 1024, uint64_t(64) << 30).empty());
  c.host_size_gb = 2;
  CHECK(contains(validate_cache_config(c, L, 1024, 0), "cache.host_ratio", "cache.host_size_gb"));
  c.host_ratio = 0;
  c.host_size_gb = 1e-6;  // below one page of this layout
  CHECK(contains(validate_cache_config(c, L, 1024, 0),
                 "cache.host_size_gb = 1e-06 is not supported for this model's KV layout", "use cache.host_ratio"));
  c.host_size_gb = 0;
  c.host_ratio = 1000;  // 688 GiB of host pool
  CHECK(contains(validate_cache_config(c, L, 1024, uint64_t(64) << 30), "RAM", "lower cache.host_ratio"));
  c.host_ratio = -1;
  CHECK(contains(validate_cache_config(c, L, 1024, 0), "cache.host_ratio = -1"));
  c = {};
  c.disk_dir = "/tmp/x";
  auto v = validate_cache_config(c, L, 1024, 0);
  CHECK(contains(v, "cache.disk_dir", "host tier"));
  CHECK(contains(v, "cache.disk_size_gb = 0", "must be > 0"));
  c = {};
  c.disk_size_gb = 3;
  CHECK(contains(validate_cache_config(c, L, 1024, 0), "cache.disk_dir is empty"));
  c = {};
  c.write_through_threshold = 0;
  CHECK(contains(validate_cache_config(c, L, 1024, 0), "cache.write_through_threshold = 0"));
  c = {};
  c.enabled = false;
  c.host_ratio = 2;
  CHECK(contains(validate_cache_config(c, L, 1024, 0), "cache.enabled = false"));
  c = {};
  c.min_load_back_tokens = -4;
  CHECK(contains(validate_cache_config(c, L, 1024, 0), "cache.min_load_back_tokens = -4"));

  CHECK(cache_host_pages(cache_config{.host_ratio = 2.5}, L, 100) == 250);
  CHECK(cache_host_pages(cache_config{.host_size_gb = 1}, L, 100) == (int64_t(1) << 30) / int64_t(L.page_bytes()));
}

TEST_CASE("radix_cache: write_back to host on L1 eviction, load-back on a hit, disk on L2 eviction") {
  page_allocator dev(4), host(3);
  radix_cache::options o;
  o.page_size = 2;
  o.policy = cache_write_policy::write_back;
  o.disk_pages = 8;
  radix_cache c(dev, &host, o);
  std::vector<copy_op> ops;
  std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto p = dev.alloc(4);
  CHECK(c.insert(t, p, ops) == 4);
  CHECK(ops.empty());  // write_back: nothing copied yet
  dev.unref_all(p);
  CHECK(dev.n_free() == 0);

  // A new request needs all 4 device pages: the leaves go first, copied to host (3 pages); once
  // host is full its LRU host-only leaf goes to disk.
  auto fresh = c.alloc_device(4, ops);
  REQUIRE(fresh.has_value());
  CHECK(c.cached_pages() == 0);
  CHECK(c.evictions(0) == 4);
  CHECK(c.evictions(1) == 1);
  int d2h = 0, h2f = 0;
  for (auto& op : ops) {
    d2h += op.kind == copy_op::device_to_host;
    h2f += op.kind == copy_op::host_to_disk;
  }
  CHECK(d2h == 4);
  CHECK(h2f == 1);
  REQUIRE(ops.size() == 5);
  CHECK(ops[3].kind == copy_op::host_to_disk);  // the disk write reads its host page ...
  CHECK(ops[4].host == ops[3].host);             // ... before the next backup overwrites it
  CHECK(ops[3].tokens == std::vector<int32_t>{7, 8});
  CHECK(c.host_cached_pages() == 3);
  CHECK(c.disk_pages() == 1);
  CHECK(c.nodes() == 3);  // host-only {1,2},{3,4},{5,6}; {7,8} lives on disk only
  dev.unref_all(*fresh);
  ops.clear();

  // Hit: 3 pages loaded back from host; the disk page needs a 4th host page, and all 3 are
  // pinned by this load, so it is recomputed (the host pool must exceed the path to use L3).
  auto m = c.match(t, 8, ops);
  CHECK(m.device_tokens == 0);
  CHECK(m.host_tokens == 6);
  CHECK(m.disk_tokens == 0);
  REQUIRE(m.pages.size() == 3);
  CHECK(ops.size() == 3);
  for (auto& op : ops) CHECK(op.kind == copy_op::host_to_device);
  CHECK(c.finish_match(m, {}) == 6);
  CHECK(c.cached_pages() == 3);
  dev.unref_all(m.pages);
  c.clear();
  CHECK(dev.n_free() == 4);
  CHECK(host.n_free() == 3);
  CHECK(c.nodes() == 0);
  CHECK(c.disk_pages() == 1);  // files outlive the tree
}

TEST_CASE("page_allocator: its O(1) evictable count equals a walk of the tree under 200 seeds of cache traffic") {
  for (uint32_t seed = 1; seed <= 200; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    page_allocator dev(24), host(12);
    radix_cache::options o;
    o.page_size = 2;
    o.policy = seed % 2 ? cache_write_policy::write_back : cache_write_policy::write_through;
    radix_cache c(dev, seed % 3 ? &host : nullptr, o);
    std::vector<copy_op> ops;
    std::vector<std::vector<int32_t>> held;  // page lists requests still reference
    auto tokens = [&] {
      std::vector<int32_t> t(1 + rng() % 9);
      for (auto& x : t) x = 1 + int32_t(rng() % 3);  // few symbols: shared prefixes
      return t;
    };
    for (int step = 0; step < 300; ++step) {
      const uint32_t op = rng() % 5;
      if (op == 0) {  // a request inserts its prompt's pages
        auto t = tokens();
        auto p = c.alloc_device(int32_t((t.size() + 1) / 2), ops);
        if (p) {
          c.insert(t, *p, ops);
          held.push_back(*p);
        }
      } else if (op == 1) {  // a request matches a prefix (pins it)
        auto m = c.match(tokens(), 100, ops);
        c.finish_match(m, {});
        held.push_back(m.pages);
      } else if (op == 2 && !held.empty()) {  // a request ends
        const size_t i = rng() % held.size();
        dev.unref_all(held[i]);
        held.erase(held.begin() + std::ptrdiff_t(i));
      } else if (op == 3) {  // an allocation that may evict
        auto p = c.alloc_device(1 + int32_t(rng() % 6), ops);
        if (p) held.push_back(*p);
      } else if (op == 4 && rng() % 10 == 0) {
        c.clear_device();
      }
      ops.clear();
      REQUIRE(dev.n_evictable() == c.evictable_pages());
    }
    for (auto& h : held) dev.unref_all(h);
    CHECK(dev.n_evictable() == c.evictable_pages());
    CHECK(dev.n_evictable() == c.cached_pages());
    c.clear();
    CHECK(dev.n_evictable() == 0);
    CHECK(dev.n_free() == 24);
  }
}

TEST_CASE("radix_cache: write_through reaches disk, disk hits load through host, a bad file ends the prefix") {
  page_allocator dev(4), host(4);
  radix_cache::options o;
  o.page_size = 2;
  o.policy = cache_write_policy::write_through;
  o.disk_pages = 8;
  radix_cache c(dev, &host, o);
  std::vector<copy_op> ops;
  std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7};
  auto p = dev.alloc(4);
  CHECK(c.insert(t, p, ops) == 3);
  dev.unref_all(p);
  CHECK(ops.size() == 6);  // D->H then H->F per page
  CHECK(c.backup_tokens(1) == 6);
  CHECK(c.backup_tokens(2) == 6);
  ops.clear();
  c.clear();  // memory tiers empty (like a restart); the disk index stays
  CHECK(c.nodes() == 0);
  CHECK(c.disk_pages() == 3);

  auto m = c.match(t, 6, ops);
  CHECK(m.disk_tokens == 6);
  REQUIRE(m.disk.size() == 3);
  CHECK(ops.size() == 6);  // F->H, H->D per page
  CHECK(ops[0].kind == copy_op::disk_to_host);
  CHECK(ops[0].parent == 0);
  CHECK(ops[2].parent == ops[0].hash);
  const uint32_t bad = static_cast<uint32_t>(m.disk[1].op_index);
  CHECK(c.finish_match(m, std::span<const uint32_t>(&bad, 1)) == 2);
  CHECK(c.disk_read_failures() == 1);
  CHECK(c.disk_pages() == 2);
  CHECK(c.nodes() == 1);
  auto drops = c.take_pending_ops();
  REQUIRE(drops.size() == 1);
  CHECK(drops[0].kind == copy_op::drop_disk);
  dev.unref_all(m.pages);
  ops.clear();
  auto m2 = c.match(t, 6, ops);
  CHECK(m2.device_tokens == 2);  // attached by the first match
  CHECK(m2.disk_tokens == 0);    // the chain is broken at the bad file
  c.finish_match(m2, {});
  dev.unref_all(m2.pages);
  c.clear();
  CHECK(dev.n_free() == 4);
  CHECK(host.n_free() == 4);
}

TEST_CASE("radix_cache: min_load_back_tokens recomputes short host hits, selective backup after N hits") {
  page_allocator dev(8), host(8);
  radix_cache::options o;
  o.page_size = 2;
  o.policy = cache_write_policy::write_through_selective;
  o.write_through_threshold = 2;
  o.min_load_back_tokens = 4;
  radix_cache c(dev, &host, o);
  std::vector<copy_op> ops;
  std::vector<int32_t> t = {1, 2, 3, 4, 5};
  auto p = dev.alloc(3);
  c.insert(t, p, ops);
  dev.unref_all(p);
  for (int hit = 1; hit <= 2; ++hit) {
    auto m = c.match(t, 4, ops);
    CHECK(m.device_tokens == 4);
    c.finish_match(m, {});
    dev.unref_all(m.pages);
    CHECK(c.host_cached_pages() == (hit == 2 ? 2 : 0));  // backed up at the 2nd hit
  }
  CHECK(ops.size() == 2);
  CHECK(c.backup_tokens(1) == 4);
  ops.clear();
  c.clear_device();
  CHECK(c.cached_pages() == 0);
  CHECK(c.host_cached_pages() == 2);
  auto m = c.match(std::vector<int32_t>{1, 2, 9, 9, 9}, 4, ops);  // a 2-token host hit < 4
  CHECK(m.tokens == 0);
  CHECK(m.skipped_tokens == 2);
  CHECK(ops.empty());
  c.finish_match(m, {});
  auto m2 = c.match(t, 4, ops);  // 4 tokens: worth loading
  CHECK(m2.host_tokens == 4);
  c.finish_match(m2, {});
  dev.unref_all(m2.pages);
  c.clear();
  CHECK(dev.n_free() == 8);
  CHECK(host.n_free() == 8);
}

TEST_CASE("cluster(fake): every write policy gives the cache-off output, L2 hits, every page returns") {
  for (auto pol : {cache_write_policy::write_through, cache_write_policy::write_through_selective,
                   cache_write_policy::write_back}) {
    CAPTURE(cache_write_policy_name(pol));
    cache_config cc;
    cc.host_ratio = 4;
    cc.write_policy = pol;
    cc.write_through_threshold = 1;
    cluster_rig c(std::make_shared<fake_model>(), tier_opts(cc));
    auto r = run_conversations(c, 4, 4, 4);
    check_expected(r, 4);
    auto* s = find_actor(r.snaps, "cache_tier");
    REQUIRE(s);
    CHECK(tier(*s, "cache_evictions_total", "device") > 0);  // the device pool is too small for 4 sessions
    CHECK(tier(*s, "cache_hit_tokens_total", "host") > 0);   // ... so later turns load back from host
    CHECK(s->value("cache_load_back_tokens_total") == tier(*s, "cache_hit_tokens_total", "host"));
    CHECK(tier(*s, "cache_backup_tokens_total", "host") > 0);
    CHECK(s->value("cache_copy_bytes_total") > 0);
    CHECK(tier(*s, "cache_pages_total", "host") == 64);
    CHECK(s->value("kv_bad_frees_total") == 0);
  }
  // L1 only, same workload: fewer reused tokens than with the host tier.
  cluster_rig c1(std::make_shared<fake_model>(), tier_opts(cache_config{}));
  auto r1 = run_conversations(c1, 4, 4, 4);
  check_expected(r1, 4);
  auto* s1 = find_actor(r1.snaps, "cache_tier");
  REQUIRE(s1);
  CHECK(tier(*s1, "cache_hit_tokens_total", "host") == 0);
  CHECK(tier(*s1, "cache_pages_total", "host") == 0);
}

TEST_CASE("cluster(fake): disk tier survives a restart, corrupted files are misses, not wrong output") {
  temp_dir d("restart");
  cache_config cc;
  cc.host_ratio = 1;
  cc.write_policy = cache_write_policy::write_through;
  cc.disk_dir = d.path;
  cc.disk_size_gb = 0.01;
  double disk_hits_first = 0;
  {
    cluster_rig c(std::make_shared<fake_model>(), tier_opts(cc));
    auto r = run_conversations(c, 4, 3, 4);
    check_expected(r, 4);
    auto* s = find_actor(r.snaps, "cache_tier");
    REQUIRE(s);
    CHECK(tier(*s, "cache_backup_tokens_total", "disk") > 0);
    CHECK(tier(*s, "cache_hit_tokens_total", "disk") > 0);  // 16 host pages hold less than 4 sessions
    disk_hits_first = tier(*s, "cache_hit_tokens_total", "disk");
  }
  const size_t files = d.files();
  CHECK(files > 0);
  {
    // A new cluster on the same directory: its tree is empty, the first turn of every session
    // finds the shared prefix and the history on disk.
    cluster_rig c(std::make_shared<fake_model>(), tier_opts(cc));
    auto r = run_conversations(c, 4, 3, 4);
    check_expected(r, 4);
    auto* s = find_actor(r.snaps, "cache_tier");
    REQUIRE(s);
    CHECK(s->value("cache_disk_restored_pages") == double(files));
    CHECK(tier(*s, "cache_hit_tokens_total", "disk") > disk_hits_first);
    CHECK(s->value("cache_disk_read_failures_total") == 0);
  }
  // Corrupt one byte in every file: every disk hit fails its checksum, output stays right.
  for (auto& e : fs::directory_iterator(d.path)) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(e.path()) / 2));
    f.put(char(0x7f));
  }
  {
    cluster_rig c(std::make_shared<fake_model>(), tier_opts(cc));
    auto r = run_conversations(c, 4, 3, 4);
    check_expected(r, 4);
    auto* s = find_actor(r.snaps, "cache_tier");
    REQUIRE(s);
    CHECK(s->value("cache_disk_read_failures_total") > 0);
  }
}

TEST_CASE("cluster(fake): bad cache settings fail at start with the validator's message") {
  cache_config cc;
  cc.host_ratio = 2;
  cc.host_size_gb = 1;
  try {
    cluster_rig c(std::make_shared<fake_model>(), tier_opts(cc));
    FAIL("conflicting host sizes must throw");
  } catch (const tandem::error& e) {
    CHECK(std::string(e.what()).find("cache.host_ratio") != std::string::npos);
  }
}

TEST_CASE("cluster(fake device): host-tier copies of a device pool go through the pinned staging ring") {
  // A device pool (host memory the fake device calls its own): every device <-> host copy of
  // the cache tier must go through the worker's ring of pinned buffers, outputs unchanged.
  auto dev = std::make_shared<fake_device_state>();
  cache_config cc;
  cc.host_ratio = 4;
  cc.write_policy = cache_write_policy::write_back;
  {
    auto o = tier_opts(cc);
    o.device = make_fake_device(dev);
    cluster_rig c(std::make_shared<fake_model>(), o);
    auto r = run_conversations(c, 4, 4, 4);
    check_expected(r, 4);
    auto* s = find_actor(r.snaps, "cache_tier");
    auto* w = find_actor(r.snaps, "worker");
    REQUIRE(s);
    REQUIRE(w);
    CHECK(tier(*s, "cache_hit_tokens_total", "host") > 0);  // pages came back from the host tier
    CHECK(w->value("worker_staging_copies_total") > 0);
    CHECK(w->value("worker_staging_copies_total") == double(dev->staged_copies));
    CHECK(w->value("worker_staging_buffers_busy") == 0);
    CHECK(w->value("worker_cache_copy_failures_total") == 0);
    CHECK(dev->pinned_allocs == 4);  // the ring, allocated once, never grown
    CHECK(dev->queue.empty());
  }
  CHECK(dev->pinned_frees == dev->pinned_allocs);  // every staging buffer returned
}
