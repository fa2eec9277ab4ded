"""Rules on a tool: CEL conditions over a proposal's arguments, checked when the policy is loaded.

A tool's policy may carry `rules`, each a CEL expression (`when`) with what it does when it holds: raise the risk
(`risk`, so the tenant's approval threshold decides), ask for people (`approvals_required`), or refuse the call
(`deny`, its text the refusal's). CEL (Google's Common Expression Language) is not Turing-complete and runs in
time linear in its size but for its comprehension macros; the expressions are compiled by the official C++
implementation (`cel-expr-python`; docs/policy.md says why that one).

Bounds, refused when the policy is loaded (the error names the rule and, for CEL's own errors, the column):
- size: at most MAX_EXPRESSION_CHARS characters and MAX_NODES nodes of the checked expression;
- cost: at most MAX_COMPREHENSIONS comprehensions (`all`, `exists`, `exists_one`, `map`, `filter`), none inside
  the body of another (a nested one is quadratic in the argument it walks). Everything else CEL does is linear in
  the expression and in the arguments, which the request size bounds; `matches` runs RE2, linear too.

Expressions see `args` (the proposal's canonical arguments), `run` (`goal`, `on_behalf_of`, `steps`: the steps the
run recorded before this one) and `agent` (`name`), nothing else: no secrets, no other tenant. A rule whose
expression cannot be evaluated (a field it reads is missing, a type it compares does not match) refuses the call,
naming the rule and why: a rule never lets a call through by failing. The decision itself is `ledger/decide.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from cel_expr_python import cel

from ledger.policy.checks import APPROVALS_REQUIRED, fail
from ledger.models import RISK_ORDER, Risk

MAX_RULES = 32
MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 200
MAX_COMPREHENSIONS = 2
MAX_REASON_CHARS = 300
RULE_KEYS = {"when", "risk", "deny", "approvals_required", "reason"}
VARIABLES = ("args", "run", "agent")

_DYN_MAP = cel.Type.Map(cel.Type.STRING, cel.Type.DYN)
_ENV = cel.NewEnv(variables={name: _DYN_MAP for name in VARIABLES})
_POSITION = re.compile(r"<input>:(\d+):(\d+): ([^\n]*)")


class CompileError(Exception):
    """The expression is not CEL, or past a bound; the message says where and why."""


# --- the checked expression, read from its serialized form -----------------------------------------------------
# `Expression.serialize()` is a google.protobuf.Any holding a cel.expr.CheckedExpr. The bounds need its tree only:
# the node count, the comprehensions and where they sit, and the `args.<name>` paths read (which the approver is
# shown). Read with protobuf's wire format alone, by the field numbers of cel/expr/syntax.proto.

def _fields(data: bytes):
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes for length-delimited."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        elif wire == 1:
            value, at = data[at:at + 8], at + 8
        elif wire == 5:
            value, at = data[at:at + 4], at + 4
        else:
            raise CompileError("the compiled expression could not be read")
        yield number, wire, value


def _varint(data: bytes, at: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[at]
        at += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, at
        shift += 7


def _first(data: bytes, number: int) -> bytes | None:
    return next((value for found, wire, value in _fields(data) if found == number and wire == 2), None)


@dataclass
class Shape:
    nodes: int = 0
    comprehensions: int = 0
    nested: bool = False
    reads: set = field(default_factory=set)  # "args.amount", "run.goal", …


# Expr: 3 const, 4 ident, 5 select, 6 call, 7 list, 8 struct, 9 comprehension.
# Select: 1 operand, 2 field. Call: 1 target, 3 args. CreateList: 1 elements. CreateStruct: 2 entries (Entry: 3 map
# key, 4 value). Comprehension: 2 iter_range, 4 accu_init, 5 loop_condition, 6 loop_step, 7 result.
def _walk(expr: bytes, shape: Shape, *, in_loop: bool) -> str | None:
    """Count `expr`'s nodes into `shape`; answer the dotted path it names when it is an ident or a select chain."""
    shape.nodes += 1
    for number, wire, value in _fields(expr):
        if wire != 2:
            continue
        if number == 4:
            return (_first(value, 1) or b"").decode()
        if number == 5:
            operand, name = _first(value, 1), (_first(value, 2) or b"").decode()
            base = _walk(operand, shape, in_loop=in_loop) if operand else None
            if base in VARIABLES or (base and base.split(".")[0] in VARIABLES):
                path = f"{base}.{name}"
                shape.reads.add(path)
                shape.reads.discard(base)
                return path
            return None
        if number == 6:
            for part, part_wire, sub in _fields(value):
                if part in (1, 3) and part_wire == 2:
                    _walk(sub, shape, in_loop=in_loop)
        elif number == 7:
            for part, part_wire, sub in _fields(value):
                if part == 1 and part_wire == 2:
                    _walk(sub, shape, in_loop=in_loop)
        elif number == 8:
            for part, part_wire, entry in _fields(value):
                if part == 2 and part_wire == 2:
                    for inner, inner_wire, sub in _fields(entry):
                        if inner in (3, 4) and inner_wire == 2:
                            _walk(sub, shape, in_loop=in_loop)
        elif number == 9:
            shape.comprehensions += 1
            shape.nested = shape.nested or in_loop
            for part, part_wire, sub in _fields(value):
                if part_wire == 2 and part in (2, 4, 7):
                    _walk(sub, shape, in_loop=in_loop)
                elif part_wire == 2 and part in (5, 6):
                    _walk(sub, shape, in_loop=True)
    return None


def shape_of(expression) -> Shape:
    checked = _first(expression.serialize(), 2)  # Any.value
    expr = _first(checked or b"", 4)  # CheckedExpr.expr
    if expr is None:
        raise CompileError("the compiled expression could not be read")
    shape = Shape()
    _walk(expr, shape, in_loop=False)
    # A macro's own variables (`x` in `all(x, …)`) are not what the call sent.
    shape.reads = {path for path in shape.reads if path.split(".")[0] in VARIABLES and "." in path}
    return shape


@lru_cache(maxsize=2048)
def compiled(text: str):
    """(the compiled expression, its shape): CompileError when it is not CEL or is past a bound."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CompileError(f"is {len(text)} characters long; an expression has at most {MAX_EXPRESSION_CHARS}")
    try:
        expression = _ENV.compile(text)
    except RuntimeError as error:
        found = _POSITION.search(str(error))
        if found:
            line, column, why = found.groups()
            where = f"column {column}" if line == "1" else f"line {line}, column {column}"
            raise CompileError(f"{where}: {why}") from None
        raise CompileError(str(error).split("\n")[0]) from None
    kind = expression.return_type()
    if kind not in (cel.Type.BOOL, cel.Type.DYN):
        raise CompileError(f"must be true or false, but it is {kind.name().lower()}")
    shape = shape_of(expression)
    if shape.nodes > MAX_NODES:
        raise CompileError(f"has {shape.nodes} parts; an expression has at most {MAX_NODES}")
    if shape.nested:
        raise CompileError("walks a list inside a walk of a list (a comprehension in the body of another), whose "
                           "cost grows with the square of the arguments' size; rules may not be that expensive")
    if shape.comprehensions > MAX_COMPREHENSIONS:
        raise CompileError(f"has {shape.comprehensions} comprehensions (all, exists, exists_one, map, filter); an "
                           f"expression has at most {MAX_COMPREHENSIONS}")
    return expression, shape


# --- parsing a tool's rules ---------------------------------------------------------------------------------------

def parse_rules(value: Any, *, where: str) -> list[dict]:
    """A tool's `rules`, validated and each expression compiled (and cached), as stored on the tool's version."""
    if value in (None, []):
        return []
    if not isinstance(value, list):
        fail(where, f"must be a list of rules ({{when, risk | deny | approvals_required, reason}}), not "
                     f"{type(value).__name__}")
    if len(value) > MAX_RULES:
        fail(where, f"has {len(value)} rules; a tool has at most {MAX_RULES}")
    return [_rule(rule, where=f"{where}[{index}]") for index, rule in enumerate(value)]


def _rule(spec: Any, *, where: str) -> dict:
    if not isinstance(spec, dict):
        fail(where, f"must be an object with when and what it does, not {type(spec).__name__}")
    unknown = set(spec) - RULE_KEYS
    if unknown:
        fail(f"{where}.{sorted(unknown)[0]}", f"is not a rule setting (known: {', '.join(sorted(RULE_KEYS))})")
    when = spec.get("when")
    if not isinstance(when, str) or not when.strip():
        fail(f"{where}.when", "must be a CEL expression over args, run and agent, like \"args.amount > 500\"")
    try:
        compiled(when)
    except CompileError as why:
        fail(f"{where}.when", str(why))
    rule = {"when": when}
    effects = [key for key in ("risk", "deny", "approvals_required") if key in spec]
    if not effects:
        fail(where, "says what it does when it holds: risk, deny or approvals_required")
    if "deny" in spec:
        if len(effects) > 1:
            fail(f"{where}.deny", "refuses the call, so it takes no risk or approvals_required beside it")
        rule["deny"] = _text(spec["deny"], f"{where}.deny")
    if "risk" in spec:
        risk = spec["risk"]
        if not isinstance(risk, str) or risk.strip().lower() not in Risk.values:
            fail(f"{where}.risk", f"must be one of {', '.join(Risk.values)}, not {risk!r}")
        rule["risk"] = risk.strip().lower()
    if "approvals_required" in spec:
        count = spec["approvals_required"]
        low, high = APPROVALS_REQUIRED
        if isinstance(count, bool) or not isinstance(count, int) or not low <= count <= high:
            fail(f"{where}.approvals_required", f"must be a whole number from {low} to {high}, not {count!r}")
        rule["approvals_required"] = count
    if "reason" in spec:
        rule["reason"] = _text(spec["reason"], f"{where}.reason")
    return rule


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        fail(where, "must be a sentence a person reads")
    if len(value) > MAX_REASON_CHARS:
        fail(where, f"is {len(value)} characters long; at most {MAX_REASON_CHARS}")
    return value.strip()


# --- evaluating ---------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One rule's answer: it `held`, or not, or could not be decided (`error`), with the values it read."""

    index: int
    rule: dict
    held: bool
    error: str = ""
    read: dict = field(default_factory=dict)


def _value_at(path: str, context: dict):
    value: Any = context
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def evaluate(rules: list[dict], context: dict) -> list[Outcome]:
    """Each rule's outcome against `context` ({args, run, agent}), in order."""
    outcomes = []
    for index, rule in enumerate(rules):
        expression, shape = compiled(rule["when"])
        read = {path: _value_at(path, context) for path in sorted(shape.reads)}
        try:
            value = expression.eval(data=context)
        except (RuntimeError, ValueError, TypeError) as error:
            outcomes.append(Outcome(index, rule, False, error=_why(str(error)), read=read))
            continue
        if value.type() == cel.Type.ERROR:
            outcomes.append(Outcome(index, rule, False, error=_why(str(value.plain_value())), read=read))
            continue
        answer = value.plain_value()
        if not isinstance(answer, bool):
            outcomes.append(Outcome(index, rule, False, error=f"it gave {answer!r}, not true or false", read=read))
            continue
        outcomes.append(Outcome(index, rule, answer, read=read))
    return outcomes


def _why(message: str) -> str:
    """CEL's error, as a person reads it ("Key not found in map : \"email\"" → "no field email")."""
    missing = re.search(r'Key not found in map : "([^"]*)"', message)
    if missing:
        return f"the call has no field {missing.group(1)!r}"
    message = re.sub(r"^[A-Z_]+: ", "", message.split("\n")[0])
    return message[:200]


def highest(risks: list[str]) -> str:
    return max(risks, key=RISK_ORDER.__getitem__)
