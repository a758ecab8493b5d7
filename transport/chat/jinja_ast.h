#pragma once
/// The syntax tree the Jinja parser builds and the evaluator walks. One generic node type
/// for expressions and one for statements keep the tree small; `op` says how to read the
/// fields.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/chat/jinja_value.h"

namespace tandem::jinja {

enum class eop : uint8_t {
  literal,      ///< lit
  name,         ///< name
  attr,         ///< args[0].name
  item,         ///< args[0][args[1]]
  slice,        ///< args[0][args[1]:args[2]:args[3]] (null parts absent)
  call,         ///< args[0](args[1..], kwargs)
  filter,       ///< args[0] | name(args[1..], kwargs)
  test,         ///< args[0] is [not] name(args[1..])
  not_,         ///< not args[0]
  neg,          ///< -args[0]
  pos,          ///< +args[0]
  binary,       ///< args[0] name args[1] (+ - * / // % ** ~)
  and_,         ///< args[0] and args[1]
  or_,          ///< args[0] or args[1]
  compare,      ///< args[0] ops[0] args[1] ops[1] args[2] ... (== != < <= > >= in notin)
  cond,         ///< args[0] if args[1] else args[2] (args[2] null: undefined)
  list,         ///< [args...]
  tuple,        ///< (args...)
  dict,         ///< {args[0]: args[1], ...}
  placeholder,  ///< the body of a filter block or a set block, fed to its filters
};

struct expr;
using expr_ptr = std::unique_ptr<expr>;

struct expr {
  eop op = eop::literal;
  bool negated = false;  ///< `is not`
  std::string name;
  value lit;
  std::vector<expr_ptr> args;
  std::vector<std::pair<std::string, expr_ptr>> kwargs;
  std::vector<std::string> ops;
  int line = 0;
  int col = 0;
};

enum class sop : uint8_t {
  text,         ///< name = the text
  output,       ///< {{ e[0] }}
  if_,          ///< if e[i]: bodies[i] ... (bodies.size() == e.size() + 1 when there is an else)
  for_,         ///< for names in e[0] [if e[1]]: bodies[0] else bodies[1]
  set,          ///< set e[1] = e[0] (target: name, attr on a namespace, or tuple of names)
  set_block,    ///< set names[0] | e[0]? %}bodies[0]{% endset
  macro,        ///< macro name(names) with defaults e (null = no default): bodies[0]
  filter_block, ///< filter e[0] (a filter chain over a placeholder): bodies[0]
  break_,
  continue_,
};

struct stmt;
using stmt_ptr = std::unique_ptr<stmt>;
using block = std::vector<stmt_ptr>;

struct stmt {
  sop op = sop::text;
  std::string name;
  std::vector<std::string> names;
  std::vector<expr_ptr> e;
  std::vector<block> bodies;
  int line = 0;
  int col = 0;
};

}  // namespace tandem::jinja
