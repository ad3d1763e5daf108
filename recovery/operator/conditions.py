"""The tiny condition language of runbook steps (`when: diagnose.verdict == dead`); never `eval`.

Grammar::

    expr    := and ("or" and)*
    and     := not ("and" not)*
    not     := "not" not | cmp
    cmp     := operand [("==" | "!=" | "<" | "<=" | ">" | ">=" | "in" | "not in") operand]
    operand := STEP.FIELD | 'string' | "string" | number | word | true | false | null
             | "[" [operand ("," operand)*] "]" | "(" expr ")"

`STEP.FIELD` reads an earlier step's result (`outcome`, `exit_code`, or a detail such as `verdict`);
a bare word is a string (`dead`). Parsing returns a small tree of tuples; every malformed input
raises one `ConditionError` naming the position. Ordering between non-numbers is simply false.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MAX_LENGTH = 500

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<num>-?\d+(?:\.\d+)?)
  | (?P<str>'[^'\\]*'|"[^"\\]*")
  | (?P<op>==|!=|<=|>=|<|>|\[|\]|\(|\)|,)
  | (?P<ref>[A-Za-z_][A-Za-z0-9_-]*\.[A-Za-z_][A-Za-z0-9_]*)
  | (?P<word>[A-Za-z_][A-Za-z0-9_-]*)
""",
    re.VERBOSE,
)
_KEYWORDS = {"and", "or", "not", "in"}
_CONSTANTS = {"true": True, "false": False, "null": None}


class ConditionError(ValueError):
    """A malformed condition (the message names what and where)."""


def tokenize(text: str) -> list[tuple[str, str, int]]:
    if not isinstance(text, str):
        raise ConditionError("a condition must be a string")
    if len(text) > MAX_LENGTH:
        raise ConditionError(f"condition longer than {MAX_LENGTH} characters")
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ConditionError(f"unexpected character {text[pos]!r} at position {pos}")
        kind = m.lastgroup or ""
        if kind != "ws":
            value = m.group(kind)
            if kind == "word" and value in _KEYWORDS:
                kind = "kw"
            tokens.append((kind, value, pos))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self, offset: int = 0) -> tuple[str, str, int] | None:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else None

    def take(self) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            raise ConditionError("condition ends too early")
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        tok = self.take()
        if tok[1] != value:
            raise ConditionError(f"expected {value!r} at position {tok[2]}, found {tok[1]!r}")

    def at(self, kind: str, value: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == kind and tok[1] == value

    def parse(self) -> tuple:
        if not self.tokens:
            raise ConditionError("empty condition")
        tree = self.expr()
        tok = self.peek()
        if tok is not None:
            raise ConditionError(f"unexpected {tok[1]!r} at position {tok[2]}")
        return tree

    def expr(self) -> tuple:
        self.depth += 1
        if self.depth > 50:
            raise ConditionError("condition nested too deeply")
        node = self.and_()
        while self.at("kw", "or"):
            self.take()
            node = ("or", node, self.and_())
        self.depth -= 1
        return node

    def and_(self) -> tuple:
        node = self.not_()
        while self.at("kw", "and"):
            self.take()
            node = ("and", node, self.not_())
        return node

    def not_(self) -> tuple:
        if self.at("kw", "not"):
            self.take()
            self.depth += 1
            if self.depth > 50:
                raise ConditionError("condition nested too deeply")
            node = ("not", self.not_())
            self.depth -= 1
            return node
        return self.cmp()

    def cmp(self) -> tuple:
        left = self.operand()
        tok = self.peek()
        if tok is None:
            return left
        if tok[0] == "op" and tok[1] in ("==", "!=", "<", "<=", ">", ">="):
            self.take()
            return ("cmp", tok[1], left, self.operand())
        if tok == ("kw", "in", tok[2]):
            self.take()
            return ("cmp", "in", left, self.operand())
        if tok[0] == "kw" and tok[1] == "not" and (nxt := self.peek(1)) is not None and nxt[1] == "in":
            self.take()
            self.take()
            return ("cmp", "not in", left, self.operand())
        return left

    def operand(self) -> tuple:
        kind, value, pos = self.take()
        if kind == "num":
            return ("lit", float(value) if "." in value else int(value))
        if kind == "str":
            return ("lit", value[1:-1])
        if kind == "ref":
            step, field = value.split(".", 1)
            return ("ref", step, field)
        if kind == "word":
            return ("lit", _CONSTANTS[value]) if value in _CONSTANTS else ("lit", value)
        if value == "(":
            node = self.expr()
            self.expect(")")
            return node
        if value == "[":
            items = []
            if not self.at("op", "]"):
                while True:
                    item = self.operand()
                    if item[0] not in ("lit", "ref"):
                        raise ConditionError(f"list items must be values (position {pos})")
                    items.append(item)
                    if self.at("op", ","):
                        self.take()
                        continue
                    break
            self.expect("]")
            return ("list", tuple(items))
        raise ConditionError(f"expected a value at position {pos}, found {value!r}")


def parse(text: str) -> tuple:
    """Text → tree; raises ConditionError (and nothing else) on malformed input."""
    try:
        return _Parser(text).parse()
    except RecursionError:
        raise ConditionError("condition nested too deeply") from None


def references(tree: tuple) -> set[str]:
    """The step names a tree reads."""
    kind = tree[0]
    if kind == "ref":
        return {tree[1]}
    if kind in ("and", "or"):
        return references(tree[1]) | references(tree[2])
    if kind == "not":
        return references(tree[1])
    if kind == "cmp":
        return references(tree[2]) | references(tree[3])
    if kind == "list":
        return set().union(*(references(t) for t in tree[1])) if tree[1] else set()
    return set()


def evaluate(tree: tuple, results: Mapping[str, Mapping[str, Any]]) -> bool:
    return bool(_value(tree, results))


def _value(tree: tuple, results: Mapping[str, Mapping[str, Any]]) -> Any:
    kind = tree[0]
    if kind == "lit":
        return tree[1]
    if kind == "ref":
        step = results.get(tree[1])
        return None if step is None else step.get(tree[2])
    if kind == "list":
        return [_value(t, results) for t in tree[1]]
    if kind == "not":
        return not _value(tree[1], results)
    if kind == "and":
        return bool(_value(tree[1], results)) and bool(_value(tree[2], results))
    if kind == "or":
        return bool(_value(tree[1], results)) or bool(_value(tree[2], results))
    op, left, right = tree[1], _value(tree[2], results), _value(tree[3], results)
    if op == "==":
        return _eq(left, right)
    if op == "!=":
        return not _eq(left, right)
    if op in ("in", "not in"):
        found = (
            any(_eq(left, item) for item in right)
            if isinstance(right, list)
            else (isinstance(left, str) and isinstance(right, str) and left in right)
        )
        return found if op == "in" else not found
    if not (_is_number(left) and _is_number(right)):
        return False
    return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right}[op]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _eq(a: Any, b: Any) -> bool:
    if _is_number(a) and _is_number(b):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    if _is_number(a) and isinstance(b, str) or isinstance(a, str) and _is_number(b):
        return str(a) == str(b)  # `exit_code == 0` written against a string detail
    return a is b if a is None or b is None or isinstance(a, bool) or isinstance(b, bool) else a == b
