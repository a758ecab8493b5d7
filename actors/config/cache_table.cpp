#include "actors/config/cache_table.h"

#include <fmt/format.h>

namespace tandem::config_detail {

using toml::value;

namespace {
/// `host_pool_share = { full = 0.75, window = 0.25 }`: how host_size_gb is split across the
/// model's pools (the names are checked against the model's layout when it is known).
void read_host_pool_share(checker& ck, const value& t, const std::string& table, cache_config& c) {
  const value* v = t.find("host_pool_share");
  if (!v) return;
  const std::string key = table + ".host_pool_share";
  if (v->type != toml::value_type::table) {
    ck.error(v->pos, key, v, "must be a table of pool fractions, e.g. { full = 0.75, window = 0.25 }");
    return;
  }
  for (const auto& e : v->entries) {
    const bool number = e.val.type == toml::value_type::floating || e.val.type == toml::value_type::integer;
    const double x = e.val.type == toml::value_type::integer ? double(e.val.integer) : e.val.floating;
    if (!number || !(x > 0) || x > 1) {
      ck.error(e.val.pos, key + "." + e.key, &e.val, "must be a fraction in (0, 1] of cache.host_size_gb; e.g. 0.25");
      continue;
    }
    c.host_pool_share.emplace_back(e.key, x);
  }
}
}  // namespace

void read_cache_table(checker& ck, const value& t, const std::string& table, cache_config& c) {
  ck.known_keys(t, table,
                {"enabled", "host_ratio", "host_size_gb", "write_policy", "write_through_threshold", "disk_dir",
                 "disk_size_gb", "min_load_back_tokens", "host_pool_share"});
  // One size of each tier: a table that sizes it replaces what it inherited, every key.
  if (t.find("host_ratio") || t.find("host_size_gb") || t.find("host_pool_share")) {
    c.host_ratio = c.host_size_gb = 0;
    c.host_pool_share.clear();
  }
  if (t.find("disk_dir") || t.find("disk_size_gb")) {
    c.disk_dir.clear();
    c.disk_size_gb = 0;
  }
  ck.boolean(t, table, "enabled", c.enabled);
  ck.real(t, table, "host_ratio", 0, 1024, "use 0 (no host tier) or e.g. 2 for twice the device pool", c.host_ratio);
  ck.real(t, table, "host_size_gb", 0, 1 << 20, "use 0 (size from host_ratio) or a size in GiB", c.host_size_gb);
  read_host_pool_share(ck, t, table, c);
  std::string policy;
  if (ck.choice(t, table, "write_policy", {"write_through", "write_through_selective", "write_back"}, policy))
    parse_cache_write_policy(policy, c.write_policy);
  int64_t v = 0;
  if (ck.integer(t, table, "write_through_threshold", 1, INT32_MAX, "use e.g. 2 hits", v))
    c.write_through_threshold = int32_t(v);
  ck.string(t, table, "disk_dir", c.disk_dir);
  ck.real(t, table, "disk_size_gb", 0, 1 << 24, "use a size in GiB, e.g. 100", c.disk_size_gb);
  if (ck.integer(t, table, "min_load_back_tokens", 0, INT32_MAX, "use 0 (= page_size) or a token count", v))
    c.min_load_back_tokens = int32_t(v);

  // Cross-field rules, on the effective settings; reported at the key of this table that is
  // involved (or the table itself when the value was inherited).
  auto at = [&](const char* key) { return t.find(key) ? t.find(key)->pos : t.pos; };
  auto key = [&](const char* k) { return table + "." + k; };
  if (c.host_ratio > 0 && c.host_size_gb > 0)
    ck.error(at("host_size_gb"), key("host_size_gb"), t.find("host_size_gb"),
             fmt::format("is exclusive with cache.host_ratio = {}; set only one of them", c.host_ratio));
  if (!c.host_pool_share.empty() && !(c.host_size_gb > 0))
    ck.error(at("host_pool_share"), key("host_pool_share"), t.find("host_pool_share"),
             c.host_ratio > 0 ? "splits cache.host_size_gb, but the host tier is sized by host_ratio (each pool gets "
                                "that multiple of its device pages); remove host_pool_share or use host_size_gb"
                              : "splits cache.host_size_gb, which is not set; add host_size_gb = <GiB>");
  if (!c.disk_dir.empty() && c.disk_size_gb <= 0 && !t.find("disk_size_gb"))
    ck.error(at("disk_dir"), key("disk_dir"), t.find("disk_dir"),
             "needs cache.disk_size_gb to bound the disk tier; add disk_size_gb = <GiB>");
  if (!c.disk_dir.empty() && t.find("disk_size_gb") && c.disk_size_gb <= 0)
    ck.error(at("disk_size_gb"), key("disk_size_gb"), t.find("disk_size_gb"),
             "must be > 0 when cache.disk_dir is set; give the disk tier's bound in GiB");
  if (c.disk_dir.empty() && c.disk_size_gb > 0)
    ck.error(at("disk_size_gb"), key("disk_size_gb"), t.find("disk_size_gb"),
             "has no effect without cache.disk_dir; set disk_dir or remove disk_size_gb");
  if (!c.enabled && (c.host_ratio > 0 || c.host_size_gb > 0 || !c.disk_dir.empty()))
    ck.error(at("enabled"), key("enabled"), t.find("enabled"),
             "turns prefix reuse off, but host/disk tiers are configured; remove the tiers or set enabled = true");
}

std::string describe_cache(const cache_config& c) {
  if (!c.enabled) return "prefix cache off";
  std::string shares;
  for (const auto& [name, x] : c.host_pool_share) shares += fmt::format("{}{} {:g}", shares.empty() ? "" : ", ", name, x);
  std::string host = c.host_size_gb > 0 ? fmt::format("host {} GiB{}", c.host_size_gb,
                                                      shares.empty() ? "" : " (" + shares + ")")
                     : c.host_ratio > 0 ? fmt::format("host {}x the device pool", c.host_ratio)
                                        : std::string("no host tier");
  std::string disk = c.disk_dir.empty() ? std::string("no disk tier")
                                        : fmt::format("disk {} GiB in '{}'", c.disk_size_gb, c.disk_dir);
  std::string policy = cache_write_policy_name(c.write_policy);
  if (c.write_policy == cache_write_policy::write_through_selective)
    policy += fmt::format(" ({} hits)", c.write_through_threshold);
  return fmt::format("{}, {}, {}", host, disk, policy);
}

}  // namespace tandem::config_detail
