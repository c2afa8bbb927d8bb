// Syntax tree of a parsed chat template (src/text/jinja): expressions and statements, each with
// the 1-based template line it starts on. Built by parser.cpp, walked by render.cpp.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "text/jinja/value.h"

namespace lily::jinja {

/// One expression node. Which fields are used depends on `kind` (see the comments).
struct Expr {
  enum class Kind {
    kLiteral,   ///< literal
    kName,      ///< name
    kList,      ///< args = elements
    kTuple,     ///< args = elements
    kDict,      ///< args = key, value, key, value, ...
    kAttr,      ///< args[0].name
    kItem,      ///< args[0][args[1]]
    kSlice,     ///< args[0][args[1]:args[2]:args[3]] (nullptr = omitted)
    kCall,      ///< args[0](args[1..], kwnames/kwargs)
    kFilter,    ///< args[0] | name(args[1..], kwnames/kwargs)
    kTest,      ///< args[0] is [not] name(args[1..]); negate
    kUnary,     ///< op args[0]: "-", "+", "not"
    kBinary,    ///< args[0] op args[1]: arithmetic, "~", comparisons, "in", "not in", "and", "or"
    kCondition, ///< args[1] if args[0] else args[2] (args[2] nullptr = undefined)
  };
  Kind kind;
  int line = 0;
  Value literal;
  std::string name;  ///< variable, attribute, filter, test name or operator
  bool negate = false;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::string> kwnames;
  std::vector<std::unique_ptr<Expr>> kwargs;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

/// One statement node.
struct Stmt {
  enum class Kind {
    kText,      ///< text
    kOutput,    ///< {{ expr }}
    kIf,        ///< conditions[i] → bodies[i]; bodies.size() > conditions.size(): else body last
    kFor,       ///< for targets in expr [if cond]: bodies[0], else bodies[1] (optional)
    kSet,       ///< targets (or ns `target_object`.`targets[0]`) = expr, or = rendered bodies[0]
    kMacro,     ///< macro name(params with defaults): bodies[0]
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;                    ///< kFor: the loop filter (`for x in xs if cond`)
  std::vector<ExprPtr> conditions; ///< kIf
  std::vector<Body> bodies;
  std::vector<std::string> targets;  ///< kFor / kSet names; kMacro: parameter names
  std::string target_object;        ///< kSet: `ns` of `set ns.attr = ...` (targets[0] = attr)
  std::vector<ExprPtr> defaults;    ///< kMacro: default per parameter (nullptr = none)
  std::string name;                 ///< kMacro
};

}  // namespace lily::jinja
