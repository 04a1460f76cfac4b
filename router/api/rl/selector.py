"""SMG's worker selector (`?selector=` of `/v1/rl/engine/{path}`): parsed once, matched against a worker's keys.

The grammar is SMG's: terms separated by commas, all of which must match (no OR):

    key=value          the key exists and equals value
    key!=value         the key is missing or differs
    key in (a,b)       the key exists and equals one of the values
    key notin (a,b)    the key is missing or equals none of them

Exact, case-sensitive matching; whitespace around keys, operators and values is ignored. Keys are made of
`A-Z a-z 0-9 _ . / -`; a value holding a comma, a space, a parenthesis or a quote is double-quoted, with `\\"`
and `\\\\` as escapes inside the quotes. A selector that does not parse raises `SelectorError` with the byte
offset of the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./-")
BARE_STOP = frozenset(' \t,()"')  # what ends an unquoted value
OPERATORS = ("=", "!=", "in", "notin")


class SelectorError(ValueError):
    def __init__(self, message: str, text: str, index: int) -> None:
        self.offset = len(text[:index].encode())  # SMG reports byte offsets
        super().__init__(f"{message} at byte {self.offset}")


@dataclass(frozen=True, slots=True)
class Term:
    key: str
    op: str  # one of OPERATORS
    values: tuple[str, ...]

    def matches(self, keys: Mapping[str, str]) -> bool:
        value = keys.get(self.key)
        if self.op in ("=", "in"):
            return value is not None and value in self.values
        return value is None or value not in self.values


@dataclass(frozen=True, slots=True)
class Selector:
    text: str
    terms: tuple[Term, ...]

    def matches(self, keys: Mapping[str, str]) -> bool:
        return all(term.matches(keys) for term in self.terms)


def parse(text: str) -> Selector:
    """The selector `text`, or SelectorError. The caller checks first that it is not empty."""
    return Selector(text, tuple(_Parser(text).terms()))


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def fail(self, message: str) -> SelectorError:
        return SelectorError(message, self.text, self.i)

    def skip_space(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def terms(self) -> list[Term]:
        terms = [self.term()]
        while True:
            self.skip_space()
            if not self.peek():
                return terms
            if self.peek() != ",":
                raise self.fail(f"expected ',' between terms, found {self.peek()!r}")
            self.i += 1
            terms.append(self.term())

    def term(self) -> Term:
        self.skip_space()
        key = self.key()
        self.skip_space()
        if self.text.startswith("!=", self.i):
            self.i += 2
            return Term(key, "!=", (self.value(),))
        if self.peek() == "=":
            self.i += 1
            return Term(key, "=", (self.value(),))
        for word in ("notin", "in"):
            if self.text.startswith(word, self.i) and self.text[self.i + len(word):][:1] not in KEY_CHARS:
                self.i += len(word)
                return Term(key, word, self.value_list())
        raise self.fail(f"expected =, !=, in or notin after key {key!r}")

    def key(self) -> str:
        start = self.i
        while self.i < len(self.text) and self.text[self.i] in KEY_CHARS:
            self.i += 1
        if self.i == start:
            raise self.fail("expected a key (letters, digits, '_', '.', '/', '-')" if self.peek()
                            else "expected a key, found the end")
        return self.text[start:self.i]

    def value_list(self) -> tuple[str, ...]:
        self.skip_space()
        if self.peek() != "(":
            raise self.fail("expected '(' to open the list of values")
        self.i += 1
        values = [self.value()]
        while True:
            self.skip_space()
            if self.peek() == ")":
                self.i += 1
                return tuple(values)
            if self.peek() != ",":
                raise self.fail("expected ',' or ')' in the list of values")
            self.i += 1
            values.append(self.value())

    def value(self) -> str:
        self.skip_space()
        if self.peek() == '"':
            return self.quoted()
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in BARE_STOP:
            self.i += 1
        if self.i == start:
            raise self.fail("expected a value (double-quote one that holds a comma, space or parenthesis)")
        return self.text[start:self.i]

    def quoted(self) -> str:
        self.i += 1  # the opening quote
        out = []
        while self.i < len(self.text):
            char = self.text[self.i]
            if char == '"':
                self.i += 1
                return "".join(out)
            if char == "\\":
                escaped = self.text[self.i + 1:self.i + 2]
                if escaped not in ('"', "\\"):
                    raise self.fail('only \\" and \\\\ are escapes inside a quoted value')
                out.append(escaped)
                self.i += 2
                continue
            out.append(char)
            self.i += 1
        raise self.fail("unterminated quoted value")
