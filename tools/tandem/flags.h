#pragma once
/// Minimal `--name value` / `--name=value` / `--switch` parser shared by the subcommands.
/// Unknown flags are an error that lists the known ones.
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "tools/tandem/exit_codes.h"

namespace tandem::cli {

class flags {
 public:
  /// Declares a flag taking a value, with its help text and default ("" = none).
  flags& opt(const std::string& name, const std::string& help, const std::string& def = "") {
    specs_[name] = {help, def, true};
    return *this;
  }
  /// Declares a boolean switch.
  flags& sw(const std::string& name, const std::string& help) {
    specs_[name] = {help, "", false};
    return *this;
  }
  /// Parses; throws usage_error naming the bad flag. Returns false if --help was given.
  bool parse(std::span<const std::string> a) {
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string& s = a[i];
      if (s == "--help" || s == "-h") return false;
      if (s.rfind("--", 0) != 0) {
        positional_.push_back(s);
        continue;
      }
      std::string name = s.substr(2), val;
      bool has_val = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        val = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_val = true;
      }
      auto it = specs_.find(name);
      if (it == specs_.end()) throw usage_error("unknown flag --" + name + "; known flags:\n" + help());
      if (it->second.takes_value && !has_val) {
        if (i + 1 >= a.size()) throw usage_error("flag --" + name + " needs a value");
        val = a[++i];
      } else if (!it->second.takes_value) {
        val = has_val ? val : "true";
      }
      values_[name] = val;
    }
    return true;
  }
  std::string str(const std::string& name) const {
    auto v = values_.find(name);
    if (v != values_.end()) return v->second;
    auto s = specs_.find(name);
    return s == specs_.end() ? "" : s->second.def;
  }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  bool on(const std::string& name) const {
    auto v = str(name);
    return v == "true" || v == "1" || v == "yes";
  }
  int64_t num(const std::string& name) const {
    auto v = str(name);
    try {
      size_t used = 0;
      int64_t r = std::stoll(v, &used);
      if (used != v.size()) throw 0;
      return r;
    } catch (...) {
      throw usage_error("flag --" + name + " expects an integer, got '" + v + "'");
    }
  }
  double real(const std::string& name) const {
    auto v = str(name);
    try {
      size_t used = 0;
      double r = std::stod(v, &used);
      if (used != v.size()) throw 0;
      return r;
    } catch (...) {
      throw usage_error("flag --" + name + " expects a number, got '" + v + "'");
    }
  }
  const std::vector<std::string>& positional() const { return positional_; }
  std::string help() const {
    std::string h;
    for (auto& [n, s] : specs_) {
      h += "  --" + n + (s.takes_value ? " VALUE" : "") + "\n      " + s.help;
      if (!s.def.empty()) h += " (default: " + s.def + ")";
      h += "\n";
    }
    return h;
  }

 private:
  struct spec {
    std::string help, def;
    bool takes_value;
  };
  std::map<std::string, spec> specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace tandem::cli
