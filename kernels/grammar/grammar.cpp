#include "kernels/grammar/grammar.h"

#include <fmt/format.h>

#include <functional>

#include "kernels/base/error.h"

namespace tandem::grammar {

expr expr::bytes(const byte_set& s) {
  expr e;
  e.k = kind::bytes;
  e.set = s;
  return e;
}
expr expr::byte(uint8_t b) {
  byte_set s;
  s.add(b);
  return bytes(s);
}
expr expr::range(uint8_t lo, uint8_t hi) {
  byte_set s;
  s.add_range(lo, hi);
  return bytes(s);
}
expr expr::literal(std::string_view s) {
  expr e;
  e.k = kind::seq;
  for (char c : s) e.kids.push_back(byte(uint8_t(c)));
  return e;
}
expr expr::ref(uint32_t rule) {
  expr e;
  e.k = kind::ref;
  e.rule = rule;
  return e;
}
expr expr::seq(std::vector<expr> kids) {
  expr e;
  e.k = kind::seq;
  e.kids = std::move(kids);
  return e;
}
expr expr::alt(std::vector<expr> kids) {
  expr e;
  e.k = kind::alt;
  e.kids = std::move(kids);
  return e;
}
expr expr::repeat(expr x, int32_t min, int32_t max) {
  expr e;
  e.k = kind::repeat;
  e.kids.push_back(std::move(x));
  e.min = min;
  e.max = max;
  return e;
}

uint32_t grammar_builder::declare(std::string name) {
  g_.rule_names.push_back(std::move(name));
  pending_.emplace_back();
  defined_.push_back(false);
  return uint32_t(pending_.size() - 1);
}

void grammar_builder::define(uint32_t rule, const expr& body) {
  if (rule >= pending_.size() || defined_[rule])
    throw tandem::error(fmt::format("grammar: rule {} defined twice or never declared", rule));
  defined_[rule] = true;
  lower_alts(rule, body);
}

uint32_t grammar_builder::set_index(const byte_set& s) {
  for (size_t i = 0; i < g_.sets.size(); ++i)
    if (g_.sets[i] == s) return uint32_t(i);
  g_.sets.push_back(s);
  return uint32_t(g_.sets.size() - 1);
}

void grammar_builder::add_alt(uint32_t r, const std::vector<element>& seq) {
  pending_[r].push_back(seq);
  n_elements_ += seq.size() + 1;
}

void grammar_builder::lower_alts(uint32_t r, const expr& e) {
  const std::string base = g_.rule_names[r];  // a copy: lowering declares rules
  if (e.k == expr::kind::alt) {
    for (const auto& kid : e.kids) {
      std::vector<element> seq;
      lower_seq(kid, seq, base);
      add_alt(r, seq);
    }
    return;
  }
  std::vector<element> seq;
  lower_seq(e, seq, base);
  add_alt(r, seq);
}

uint32_t grammar_builder::helper(const std::string& base, const expr& e) {
  uint32_t h = declare(fmt::format("{}-{}", base, pending_.size()));
  defined_[h] = true;
  lower_alts(h, e);
  return h;
}

void grammar_builder::lower_seq(const expr& e, std::vector<element>& out, const std::string& base) {
  switch (e.k) {
    case expr::kind::bytes:
      out.push_back({elem_kind::bytes, set_index(e.set)});
      return;
    case expr::kind::ref:
      out.push_back({elem_kind::rule, e.rule});
      return;
    case expr::kind::seq:
      for (const auto& kid : e.kids) lower_seq(kid, out, base);
      return;
    case expr::kind::alt:
      if (e.kids.size() == 1) return lower_seq(e.kids[0], out, base);
      out.push_back({elem_kind::rule, helper(base, e)});
      return;
    case expr::kind::repeat: {
      const expr& x = e.kids.at(0);
      // A compound item becomes one rule, referenced by every copy.
      const bool simple = x.k == expr::kind::bytes || x.k == expr::kind::ref;
      const expr item = simple ? x : expr::ref(helper(base, x));
      for (int32_t i = 0; i < e.min; ++i) lower_seq(item, out, base);
      if (e.max < 0) {
        // star ::= item star | ""  (right recursion: the matcher's stack does not grow)
        uint32_t s = declare(fmt::format("{}-{}", base, pending_.size()));
        defined_[s] = true;
        std::vector<element> a;
        lower_seq(item, a, base);
        a.push_back({elem_kind::rule, s});
        add_alt(s, a);
        add_alt(s, {});
        out.push_back({elem_kind::rule, s});
        return;
      }
      // (item (item (...)?)?)?: innermost first.
      int64_t prev = -1;
      for (int32_t i = e.min; i < e.max; ++i) {
        uint32_t o = declare(fmt::format("{}-{}", base, pending_.size()));
        defined_[o] = true;
        std::vector<element> a;
        lower_seq(item, a, base);
        if (prev >= 0) a.push_back({elem_kind::rule, uint32_t(prev)});
        add_alt(o, a);
        add_alt(o, {});
        prev = o;
      }
      if (prev >= 0) out.push_back({elem_kind::rule, uint32_t(prev)});
      return;
    }
  }
}

grammar grammar_builder::finish(uint32_t root) {
  const size_t n = pending_.size();
  for (size_t r = 0; r < n; ++r)
    if (!defined_[r]) throw tandem::error(fmt::format("grammar: rule '{}' is used but never defined", g_.rule_names[r]));
  // Nullable rules (fixpoint), then a rule reachable from itself through nullable prefixes is
  // left-recursive: the matcher's expansion would not terminate.
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const auto& a : pending_[r]) {
        bool all = true;
        for (const auto& el : a)
          if (el.kind == elem_kind::bytes || (el.kind == elem_kind::rule && !nullable[el.arg])) {
            all = false;
            break;
          }
        if (all) {
          nullable[r] = changed = true;
          break;
        }
      }
    }
  }
  std::vector<uint8_t> mark(n, 0);  // 0 new, 1 on the path, 2 done
  std::function<void(uint32_t)> visit = [&](uint32_t r) {
    if (mark[r] == 2) return;
    if (mark[r] == 1)
      throw tandem::error(fmt::format("grammar: rule '{}' is left-recursive; rewrite it with repetition",
                                      g_.rule_names[r]));
    mark[r] = 1;
    for (const auto& a : pending_[r])
      for (const auto& el : a) {
        if (el.kind == elem_kind::bytes) break;
        visit(el.arg);
        if (!nullable[el.arg]) break;
      }
    mark[r] = 2;
  };
  for (uint32_t r = 0; r < n; ++r) visit(r);
  g_.rule_alts.assign(n, {});
  g_.elems.clear();
  for (size_t r = 0; r < n; ++r)
    for (const auto& a : pending_[r]) {
      g_.rule_alts[r].push_back(uint32_t(g_.elems.size()));
      g_.elems.insert(g_.elems.end(), a.begin(), a.end());
      g_.elems.push_back({elem_kind::end, 0});
    }
  g_.root = root;
  return g_;
}

namespace {
std::string set_text(const byte_set& s) {
  std::string out = "[";
  for (unsigned b = 0; b < 256;) {
    if (!s.has(uint8_t(b))) {
      ++b;
      continue;
    }
    unsigned e = b;
    while (e + 1 < 256 && s.has(uint8_t(e + 1))) ++e;
    auto one = [](unsigned c) {
      return c >= 0x21 && c < 0x7f && c != ']' && c != '\\' && c != '-' ? std::string(1, char(c))
                                                                       : fmt::format("\\x{:02X}", c);
    };
    out += one(b);
    if (e > b) out += "-" + one(e);
    b = e + 1;
  }
  return out + "]";
}
}  // namespace

std::string grammar::to_text() const {
  std::string out;
  for (size_t r = 0; r < rule_alts.size(); ++r) {
    out += rule_names[r] + " ::=";
    for (size_t a = 0; a < rule_alts[r].size(); ++a) {
      if (a) out += " |";
      for (size_t i = rule_alts[r][a]; elems[i].kind != elem_kind::end; ++i)
        out += " " + (elems[i].kind == elem_kind::bytes ? set_text(sets[elems[i].arg]) : rule_names[elems[i].arg]);
      if (elems[rule_alts[r][a]].kind == elem_kind::end) out += " \"\"";
    }
    out += "\n";
  }
  return out;
}

}  // namespace tandem::grammar
