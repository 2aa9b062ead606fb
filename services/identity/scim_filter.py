"""SCIM filters and PATCH paths (RFC 7644 §3.4.2.2, §3.5.2): a small parser and evaluator, pure.

``userName eq "alice" and not (emails co "@old.example")``, ``emails[type eq "work"].value``: parsed to
plain structs, checked against the attributes a resource type keeps (an unknown attribute, or ``gt`` on a
boolean, is the client's mistake: :class:`FilterError`, which the endpoint answers 400 ``invalidFilter``),
then evaluated over a resource as the endpoint renders it (its SCIM JSON as a dict).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import msgspec

MAX_FILTER = 2000  # characters; a longer filter is refused, not parsed
MAX_DEPTH = 32  # nested parentheses, brackets and nots
COMPARE_OPS = ("eq", "ne", "co", "sw", "ew", "gt", "ge", "lt", "le")
ORDERED_OPS = ("gt", "ge", "lt", "le")
TEXT_OPS = ("co", "sw", "ew")

Value = str | int | float | bool | None


class FilterError(ValueError):
    """A filter or path the client got wrong; ``scim_type`` is RFC 7644's (invalidFilter, invalidPath)."""

    def __init__(self, detail: str, scim_type: str = "invalidFilter") -> None:
        super().__init__(detail)
        self.detail, self.scim_type = detail, scim_type


class Compare(msgspec.Struct, frozen=True):
    path: str  # dotted, lower case, without its schema: "username", "emails.value"
    op: str
    value: Value


class Present(msgspec.Struct, frozen=True):
    path: str


class And(msgspec.Struct, frozen=True):
    left: Filter
    right: Filter


class Or(msgspec.Struct, frozen=True):
    left: Filter
    right: Filter


class Not(msgspec.Struct, frozen=True):
    inner: Filter


class ValuePath(msgspec.Struct, frozen=True):
    """``emails[type eq "work"]``: some value of a multi-valued attribute meets the inner filter (whose
    paths are relative to that value)."""

    attr: str
    inner: Filter


Filter = Compare | Present | And | Or | Not | ValuePath


class AttrInfo(msgspec.Struct, frozen=True):
    """What a filter may ask of an attribute: its SCIM type and whether text compares exactly."""

    type: str = "string"  # string | boolean | dateTime | reference | complex
    case_exact: bool = False


class PatchPath(msgspec.Struct, frozen=True):
    """A PATCH operation's target: ``attr``, ``attr.sub``, ``attr[filter]`` or ``attr[filter].sub``."""

    attr: str  # lower case, without its schema
    value_filter: Filter | None = None
    sub: str = ""  # lower case
    schema: str = ""  # the schema URN it was written with ("" : none)


# -- tokens ------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<punct>[()\[\]])
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<number>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w:.$-]))
      | (?P<word>[A-Za-z0-9_$:.\-]+)
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise FilterError(f"the filter cannot be read at character {pos + 1}: {text[pos : pos + 20]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def split_schema(path: str) -> tuple[str, str]:
    """(schema URN, attribute path) of ``urn:…:User:userName`` or (``""``, ``userName``)."""
    if ":" not in path:
        return "", path
    schema, _, attr = path.rpartition(":")
    return schema, attr


class _Parser:
    def __init__(self, text: str) -> None:
        if len(text) > MAX_FILTER:
            raise FilterError(f"the filter is longer than {MAX_FILTER} characters")
        if not text.strip():
            raise FilterError("the filter is empty")
        self.tokens = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def word(self) -> str:
        t = self.peek()
        return t[1].lower() if t and t[0] == "word" else ""

    def take(self, kind: str, value: str | None = None) -> str:
        t = self.peek()
        if t is None or t[0] != kind or (value is not None and t[1] != value):
            got = repr(t[1]) if t else "the end"
            raise FilterError(f"expected {value or kind} but found {got}")
        self.i += 1
        return t[1]

    def nested(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise FilterError(f"the filter nests deeper than {MAX_DEPTH}")

    def parse(self) -> Filter:
        f = self.or_()
        if self.peek() is not None:
            raise FilterError(f"unexpected {self.peek()[1]!r} after a complete filter")  # type: ignore[index]
        return f

    def or_(self) -> Filter:
        f = self.and_()
        while self.word() == "or":
            self.i += 1
            f = Or(f, self.and_())
        return f

    def and_(self) -> Filter:
        f = self.unary()
        while self.word() == "and":
            self.i += 1
            f = And(f, self.unary())
        return f

    def unary(self) -> Filter:
        t = self.peek()
        if t is None:
            raise FilterError("the filter ends where an expression was expected")
        if t == ("punct", "("):
            self.i += 1
            self.nested()
            f = self.or_()
            self.take("punct", ")")
            self.depth -= 1
            return f
        if self.word() == "not":
            self.i += 1
            self.nested()
            self.take("punct", "(")
            f = self.or_()
            self.take("punct", ")")
            self.depth -= 1
            return Not(f)
        if t[0] != "word":
            raise FilterError(f"expected an attribute but found {t[1]!r}")
        path = attr_path(self.take("word"))
        nxt = self.peek()
        if nxt == ("punct", "["):
            self.i += 1
            self.nested()
            inner = self.or_()
            self.take("punct", "]")
            self.depth -= 1
            return ValuePath(path, inner)
        op = self.word()
        if op == "pr":
            self.i += 1
            return Present(path)
        if op not in COMPARE_OPS:
            got = repr(nxt[1]) if nxt else "the end"
            raise FilterError(f"expected an operator ({', '.join(COMPARE_OPS)}, pr) after {path} but found {got}")
        self.i += 1
        return Compare(path, op, self.value())

    def value(self) -> Value:
        t = self.peek()
        if t is None:
            raise FilterError("the filter ends where a value was expected")
        self.i += 1
        kind, text = t
        if kind == "string":
            try:
                return str(json.loads(text))
            except ValueError as exc:
                raise FilterError(f"the string {text[:40]} is not valid: {exc}") from exc
        if kind == "number":
            return float(text) if any(c in text for c in ".eE") else int(text)
        if kind == "word" and text.lower() in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[text.lower()]
        raise FilterError(f'a value is a "string" in double quotes, a number, true, false or null, not {text!r}')


def attr_path(text: str) -> str:
    """``urn:…:User:name.givenName`` → ``name.givenname`` (the schema is checked by :func:`check`)."""
    _, attr = split_schema(text)
    if not attr or not re.fullmatch(r"\$?[A-Za-z][\w$-]*(\.[A-Za-z$][\w$-]*)?", attr):
        raise FilterError(f"{text[:60]!r} is not an attribute path")
    return attr.lower()


def parse_filter(text: str) -> Filter:
    """The filter ``text`` as a struct tree; raises :class:`FilterError`."""
    return _Parser(text).parse()


def parse_path(text: str) -> PatchPath:
    """A PATCH ``path`` (RFC 7644 §3.5.2); raises :class:`FilterError` with scimType invalidPath."""
    try:
        text = text.strip()
        bracket = text.find("[")
        head = text if bracket < 0 else text[:bracket]
        schema, _ = split_schema(head)
        if bracket < 0:
            path = attr_path(text)
            attr, _, sub = path.partition(".")
            return PatchPath(attr=attr, sub=sub, schema=schema)
        close = text.rfind("]")
        if close < bracket:
            raise FilterError(f"the path {text[:60]!r} opens a [ it does not close")
        attr = attr_path(head)
        if "." in attr:
            raise FilterError(f"a value filter applies to a multi-valued attribute, not {attr}")
        inner = parse_filter(text[bracket + 1 : close])
        rest = text[close + 1 :]
        sub = ""
        if rest:
            if not rest.startswith(".") or not re.fullmatch(r"\.[A-Za-z$][\w$-]*", rest):
                raise FilterError(f"after ] a path goes on with .subAttribute, not {rest[:40]!r}")
            sub = rest[1:].lower()
        return PatchPath(attr=attr, value_filter=inner, sub=sub, schema=schema)
    except FilterError as exc:
        raise FilterError(f"the path {text[:80]!r} is not valid: {exc.detail}", "invalidPath") from exc


# -- checking against what a resource keeps --------------------------------------------------------


def check(f: Filter, attributes: Mapping[str, AttrInfo], prefix: str = "") -> None:
    """Raise :class:`FilterError` when ``f`` names an attribute not in ``attributes`` (dotted, lower case)
    or compares one in a way its type does not allow."""
    match f:
        case And(left, right) | Or(left, right):
            check(left, attributes, prefix)
            check(right, attributes, prefix)
        case Not(inner):
            check(inner, attributes, prefix)
        case ValuePath(attr, inner):
            if prefix:
                raise FilterError("a value filter cannot be nested in another")
            _info(attr, attributes)
            check(inner, attributes, f"{attr}.")
        case Present(path):
            _info(prefix + path, attributes)
        case Compare(path, op, value):
            info = _info(prefix + path, attributes)
            if info.type == "boolean" and (op not in ("eq", "ne") or not isinstance(value, bool)):
                raise FilterError(f"{prefix + path} is true or false: compare it with eq or ne and true or false")
            if info.type == "complex":
                raise FilterError(f"{prefix + path} has sub-attributes: compare one of them")
            if op in TEXT_OPS + ORDERED_OPS and not isinstance(value, str):
                raise FilterError(f"{op} compares text: give a string in double quotes")


def _info(path: str, attributes: Mapping[str, AttrInfo]) -> AttrInfo:
    info = attributes.get(path)
    if info is None and f"{path}.value" in attributes:  # a multi-valued attribute stands for its values
        info = attributes[f"{path}.value"]
    if info is None:
        known = ", ".join(sorted(a for a in attributes if attributes[a].type != "complex"))
        raise FilterError(f"this server does not filter on {path!r}; it filters on {known}")
    return info


# -- evaluating ------------------------------------------------------------------------------------


def _lookup(obj: Mapping[str, Any], name: str) -> Any:
    if name in obj:
        return obj[name]
    lowered = name.lower()
    return next((v for k, v in obj.items() if k.lower() == lowered), None)


def values_at(resource: Mapping[str, Any], path: str) -> list[Any]:
    """Every value ``path`` (dotted, any case) reaches in ``resource``: a multi-valued complex attribute
    without a sub-attribute reaches its values' ``value``."""
    head, _, sub = path.partition(".")
    got = _lookup(resource, head)
    items = got if isinstance(got, list) else [got]
    out: list[Any] = []
    for item in items:
        if item is None:
            continue
        if isinstance(item, Mapping):
            inner = _lookup(item, sub or "value")
            if inner is not None:
                out.append(inner)
        elif not sub:
            out.append(item)
    return out


def _compare(actual: Any, op: str, wanted: Value, exact: bool) -> bool:
    if isinstance(actual, bool) or isinstance(wanted, bool) or wanted is None:
        same = actual == wanted and type(actual) is type(wanted)
        return same if op == "eq" else not same if op == "ne" else False
    if isinstance(actual, str) and isinstance(wanted, str):
        a, w = (actual, wanted) if exact else (actual.lower(), wanted.lower())
    elif isinstance(actual, int | float) and isinstance(wanted, int | float):
        a, w = actual, wanted  # type: ignore[assignment]
    else:
        return op == "ne"
    match op:
        case "eq":
            return a == w
        case "ne":
            return a != w
        case "co":
            return isinstance(a, str) and w in a  # type: ignore[operator]
        case "sw":
            return isinstance(a, str) and a.startswith(w)  # type: ignore[arg-type]
        case "ew":
            return isinstance(a, str) and a.endswith(w)  # type: ignore[arg-type]
        case "gt":
            return a > w  # type: ignore[operator]
        case "ge":
            return a >= w  # type: ignore[operator]
        case "lt":
            return a < w  # type: ignore[operator]
        case "le":
            return a <= w  # type: ignore[operator]
    return False


def matches(f: Filter, resource: Mapping[str, Any], attributes: Mapping[str, AttrInfo] | None = None) -> bool:
    """Whether ``resource`` (its SCIM JSON) meets ``f``; text compares ignoring case unless ``attributes``
    says the attribute is case-exact."""
    attributes = attributes or {}
    match f:
        case And(left, right):
            return matches(left, resource, attributes) and matches(right, resource, attributes)
        case Or(left, right):
            return matches(left, resource, attributes) or matches(right, resource, attributes)
        case Not(inner):
            return not matches(inner, resource, attributes)
        case Present(path):
            return any(v not in ("", [], {}) for v in values_at(resource, path))
        case ValuePath(attr, inner):
            items = _lookup(resource, attr)
            items = items if isinstance(items, list) else [items]
            scoped = {k.removeprefix(f"{attr}."): v for k, v in attributes.items() if k.startswith(f"{attr}.")}
            return any(isinstance(i, Mapping) and matches(inner, i, scoped) for i in items)
        case Compare(path, op, value):
            info = attributes.get(path) or attributes.get(f"{path}.value") or AttrInfo()
            found = values_at(resource, path)
            if op == "ne":  # no value equals it (an absent attribute equals nothing)
                return not any(_compare(v, "eq", value, info.case_exact) for v in found)
            return any(_compare(v, op, value, info.case_exact) for v in found)
    return False  # pragma: no cover - a closed union
