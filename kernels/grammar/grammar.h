#pragma once
/// A context-free grammar over bytes, in the flat form the matcher walks (as llama.cpp's GBNF
/// rules): each rule is a list of alternatives, each alternative a sequence of byte sets and
/// references to rules. Built with `grammar_builder` from small expressions (sequence,
/// alternative, bounded/unbounded repetition); the builder lowers those to helper rules, with
/// repetition as right recursion so a matcher's stacks do not grow with the repeat count.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::grammar {

/// A set of bytes (256 bits).
struct byte_set {
  std::array<uint64_t, 4> w{};
  bool has(uint8_t b) const { return (w[b >> 6] >> (b & 63)) & 1; }
  void add(uint8_t b) { w[b >> 6] |= uint64_t(1) << (b & 63); }
  void add_range(uint8_t lo, uint8_t hi) {
    for (unsigned b = lo; b <= hi; ++b) add(uint8_t(b));
  }
  bool operator==(const byte_set&) const = default;
};

enum class elem_kind : uint8_t { bytes, rule, end };

/// One element of an alternative: a byte set (arg = index in sets), a rule reference (arg =
/// rule id) or the end of the alternative.
struct element {
  elem_kind kind = elem_kind::end;
  uint32_t arg = 0;
};

/// The compiled grammar: immutable once built.
struct grammar {
  std::vector<byte_set> sets;
  std::vector<element> elems;                      ///< alternatives, each closed by an `end`
  std::vector<std::vector<uint32_t>> rule_alts;    ///< per rule: start index of each alternative
  std::vector<std::string> rule_names;
  uint32_t root = 0;
  /// GBNF-like text (for logs and tests).
  std::string to_text() const;
};

/// An expression the builder lowers to rules.
struct expr {
  enum class kind : uint8_t { bytes, ref, seq, alt, repeat };
  kind k = kind::seq;
  byte_set set;
  uint32_t rule = 0;
  std::vector<expr> kids;
  int32_t min = 0, max = -1;  ///< repeat bounds; max -1 = unbounded

  static expr bytes(const byte_set& s);
  static expr byte(uint8_t b);
  static expr range(uint8_t lo, uint8_t hi);
  static expr literal(std::string_view s);  ///< "" gives the empty sequence
  static expr ref(uint32_t rule);
  static expr seq(std::vector<expr> kids);
  static expr alt(std::vector<expr> kids);
  static expr repeat(expr x, int32_t min, int32_t max);
  static expr opt(expr x) { return repeat(std::move(x), 0, 1); }
  static expr star(expr x) { return repeat(std::move(x), 0, -1); }
};

/// Builds a grammar rule by rule; rules may refer to each other (and themselves) before they
/// are defined, but every declared rule must be defined before `finish`.
class grammar_builder {
 public:
  uint32_t declare(std::string name);
  void define(uint32_t rule, const expr& body);
  uint32_t add(std::string name, const expr& body) {
    uint32_t r = declare(std::move(name));
    define(r, body);
    return r;
  }
  /// Throws tandem::error if a rule is undefined or the grammar is left-recursive.
  grammar finish(uint32_t root);
  /// Elements lowered so far (bounds a compiler's output before `finish`).
  size_t n_elements() const { return n_elements_; }

 private:
  uint32_t set_index(const byte_set& s);
  /// Appends the alternatives of `e` (as top-level alternatives) to rule `r`.
  void lower_alts(uint32_t r, const expr& e);
  void lower_seq(const expr& e, std::vector<element>& out, const std::string& base);
  uint32_t helper(const std::string& base, const expr& e);
  void add_alt(uint32_t r, const std::vector<element>& seq);
  grammar g_;
  std::vector<std::vector<std::vector<element>>> pending_;  ///< per rule, its alternatives
  std::vector<bool> defined_;
  size_t n_elements_ = 0;
};

}  // namespace tandem::grammar
