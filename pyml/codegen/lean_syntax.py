"""Lean as trees: the terms and declarations pyml emits, one printer, and a parser.

Every Lean term the generator writes is built here as a tree and printed by `print_term`, which
puts parentheses around every argument that is not atomic; nothing is glued from strings, so
`.layer (Layer.gain 640) .nil.append ...` (which Lean reads as four arguments to `.layer`)
cannot be written. The parser reads back what the printer writes, the law statements of
`lean/PyML` (so an instance substitutes dims in a tree, not in text) and the declaration headers
there (`pyml.codegen.lean_check` checks emitted files against them). It covers the subset of
Lean that those use: names, numerals, applications, anonymous constructors (`.nil`), field
access (`(e).f`, `x.1`), the infix operators below, `fun`, `∀`, `if then else`, `⟨a, b⟩`,
binders and `def`/`theorem` with `:=` or match alternatives. It is no substitute for Lean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# -- terms ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Name:
    """An identifier, possibly dotted: `dot`, `Layer.gain`, `skeleton.forward`."""

    text: str


@dataclass(frozen=True)
class Num:
    value: int


@dataclass(frozen=True)
class Ctor:
    """`.layer`: the constructor `layer` of the type the context expects."""

    name: str


@dataclass(frozen=True)
class Field:
    """`(e).f` or `x.1`: generalised field notation on a term that is not a plain name."""

    receiver: Term
    name: str


@dataclass(frozen=True)
class App:
    fn: Term
    args: tuple[Term, ...]


@dataclass(frozen=True)
class Binary:
    op: str
    left: Term
    right: Term


@dataclass(frozen=True)
class Prefix:
    op: str  # "¬" or "-"
    operand: Term


@dataclass(frozen=True)
class Binder:
    """`(a b : T)`, `{m n : Nat}` or `[Decidable c]`; `fun`'s and `∀`'s binders may have no type."""

    names: tuple[str, ...]
    type: Term | None = None
    bracket: str = "("  # "(" explicit, "{" implicit, "[" instance

    @property
    def explicit(self) -> bool:
        return self.bracket == "("


@dataclass(frozen=True)
class Pi:
    """`(x : A) → B` or `{x : A} → B` (a non-dependent arrow is `Binary("→", A, B)`)."""

    binder: Binder
    body: Term


@dataclass(frozen=True)
class Fun:
    binders: tuple[Binder, ...]
    body: Term


@dataclass(frozen=True)
class Forall:
    binders: tuple[Binder, ...]
    body: Term


@dataclass(frozen=True)
class Ite:
    condition: Term
    then: Term
    otherwise: Term


@dataclass(frozen=True)
class Anonymous:
    """`⟨a, b⟩`."""

    items: tuple[Term, ...]


@dataclass(frozen=True)
class Typed:
    """`(t : T)`."""

    term: Term
    type: Term


Term = Name | Num | Ctor | Field | App | Binary | Prefix | Pi | Fun | Forall | Ite | Anonymous | Typed


def apply(fn: str | Term, *args: Term | int | str) -> Term:
    """`fn args…`, with ints as numerals and strings as names; no arguments gives `fn` itself."""
    fn = Name(fn) if isinstance(fn, str) else fn
    args = tuple(Num(a) if isinstance(a, int) else Name(a) if isinstance(a, str) else a
                 for a in args)
    return App(fn, args) if args else fn


# -- declarations -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Def:
    """`def name binders : type := body`."""

    name: str
    binders: tuple[Binder, ...]
    type: Term
    body: Term
    doc: str = ""


@dataclass(frozen=True)
class MatchDef:
    """`def name : type` followed by `| patterns => body` alternatives."""

    name: str
    type: Term
    alternatives: tuple[tuple[tuple[Term, ...], Term], ...]
    doc: str = ""


@dataclass(frozen=True)
class Theorem:
    name: str
    binders: tuple[Binder, ...]
    type: Term
    proof: Term
    doc: str = ""
    comment: str = ""  # a `--` line above it


@dataclass(frozen=True)
class Section:
    """`/-! text -/`: a heading between declarations."""

    text: str


Declaration = Def | MatchDef | Theorem


@dataclass(frozen=True)
class Module:
    """A generated Lean file: header comments, imports, one namespace with `open`s, its items."""

    header: tuple[str, ...]
    imports: tuple[str, ...]
    namespace: str
    opens: tuple[str, ...]
    items: tuple[Section | Declaration, ...] = field(default=())


# -- the printer ------------------------------------------------------------------------------------

# (precedence, associativity) of the infix operators, as Lean's core notations declare them.
INFIX = {
    "↔": (20, "none"), "→": (25, "right"), "∨": (30, "right"), "∧": (35, "right"),
    "×": (35, "right"), "=": (50, "none"), "≠": (50, "none"), "<": (50, "none"),
    "≤": (50, "none"), "+": (65, "left"), "-": (65, "left"), "*": (70, "left"),
}
PREFIX = {"¬": 40, "-": 75}  # the operand's precedence
MAX = 1024  # an argument's precedence: only atoms are printed bare there
APPLICATION = 1023


def precedence(term: Term) -> int:
    if isinstance(term, (Name, Num, Ctor, Field, Anonymous, Typed)):
        return MAX
    if isinstance(term, App):
        return APPLICATION
    if isinstance(term, Binary):
        return INFIX[term.op][0]
    if isinstance(term, Prefix):
        return PREFIX[term.op]
    return 0  # fun, ∀, if, Pi: they extend as far as they can, so parenthesise them everywhere


def print_term(term: Term, at_least: int = 0) -> str:
    """The term's text, parenthesised if it binds less tightly than `at_least`."""
    text = _print(term)
    return f"({text})" if precedence(term) < at_least else text


def _print(term: Term) -> str:
    if isinstance(term, Name):
        return term.text
    if isinstance(term, Num):
        return str(term.value)
    if isinstance(term, Ctor):
        return f".{term.name}"
    if isinstance(term, Field):
        # `.nil.append` is one constructor name and `2.1` a decimal: only a name, a field or a
        # bracketed term takes a field without parentheses
        receiver = _print(term.receiver)
        if not isinstance(term.receiver, (Name, Field, Anonymous, Typed)):
            receiver = f"({receiver})"
        return f"{receiver}.{term.name}"
    if isinstance(term, App):
        return " ".join([print_term(term.fn, MAX), *(print_term(arg, MAX) for arg in term.args)])
    if isinstance(term, Binary):
        level, side = INFIX[term.op]
        left = print_term(term.left, level if side == "left" else level + 1)
        right = print_term(term.right, level if side == "right" else level + 1)
        return f"{left} {term.op} {right}"
    if isinstance(term, Prefix):
        return f"{term.op}{' ' if term.op == '¬' else ''}{print_term(term.operand, PREFIX[term.op])}"
    if isinstance(term, Pi):
        return f"{print_binder(term.binder)} → {print_term(term.body)}"
    if isinstance(term, Fun):
        return f"fun {' '.join(print_binder(b) for b in term.binders)} => {print_term(term.body)}"
    if isinstance(term, Forall):
        return f"∀ {' '.join(print_binder(b) for b in term.binders)}, {print_term(term.body)}"
    if isinstance(term, Ite):
        return (f"if {print_term(term.condition)} then {print_term(term.then)} "
                f"else {print_term(term.otherwise)}")
    if isinstance(term, Anonymous):
        return "⟨" + ", ".join(print_term(item) for item in term.items) + "⟩"
    if isinstance(term, Typed):
        return f"({print_term(term.term)} : {print_term(term.type)})"
    raise TypeError(f"not a Lean term: {term!r}")


def print_binder(binder: Binder) -> str:
    names = " ".join(binder.names)
    if binder.type is None:
        return names
    close = {"(": ")", "{": "}", "[": "]"}[binder.bracket]
    inner = print_term(binder.type) if not names else f"{names} : {print_term(binder.type)}"
    return f"{binder.bracket}{inner}{close}"


def print_declaration(item: Section | Declaration) -> str:
    if isinstance(item, Section):
        return f"/-! {item.text} -/"
    lines = [f"/-- {item.doc} -/"] if item.doc else []
    if isinstance(item, Theorem) and item.comment:
        lines.insert(0, f"-- {item.comment}")
    binders = "".join(" " + print_binder(b) for b in getattr(item, "binders", ()))
    if isinstance(item, Def):
        lines += [f"def {item.name}{binders} : {print_term(item.type)} :=", f"  {print_term(item.body)}"]
    elif isinstance(item, MatchDef):
        lines.append(f"def {item.name} : {print_term(item.type)}")
        lines += [f"  | {', '.join(print_term(p) for p in patterns)} => {print_term(body)}"
                  for patterns, body in item.alternatives]
    elif binders:
        lines += [f"theorem {item.name}{binders} :", f"    {print_term(item.type)} :=",
                  f"  {print_term(item.proof)}"]
    else:
        lines += [f"theorem {item.name} : {print_term(item.type)} :=", f"  {print_term(item.proof)}"]
    return "\n".join(lines)


def print_module(module: Module) -> str:
    lines = [f"-- {line}" for line in module.header]
    lines += [f"import {name}" for name in module.imports]
    lines += ["", f"namespace {module.namespace}", *(f"open {name}" for name in module.opens)]
    for item in module.items:
        lines += ["", print_declaration(item)]
    lines += ["", f"end {module.namespace}", ""]
    return "\n".join(lines)


# -- the parser -------------------------------------------------------------------------------------


class LeanSyntaxError(ValueError):
    """Text outside the subset of Lean that pyml emits and reads."""


_IDENT = r"[^\W\d][\w'!?₀-₉]*"
_TOKEN = re.compile(rf"""
    (?P<space>[ \t\r]+) | (?P<newline>\n)
  | (?P<comment>--[^\n]*)
  | (?P<block>/-[-!]?.*?-/)
  | (?P<field>(?<=[\w'!?₀-₉)⟩])\.(?:{_IDENT}|\d+))
  | (?P<ctor>\.{_IDENT}(?:\.{_IDENT})*)
  | (?P<name>{_IDENT}(?:\.{_IDENT})*)
  | (?P<num>\d+)
  | (?P<symbol>:=|=>|[()\[\]{{}}⟨⟩,:|_→×↔∧∨=≠<≤+\-*¬∀@])
""", re.VERBOSE | re.DOTALL)
KEYWORDS = {"fun", "if", "then", "else", "def", "theorem", "abbrev", "inductive", "where",
            "namespace", "end", "open", "import", "by", "match", "with", "at"}


@dataclass(frozen=True)
class Token:
    kind: str  # "name", "num", "ctor", "field", "symbol", "keyword", "comment", "block", "newline"
    text: str
    line: int
    column: int


def tokens(text: str) -> list[Token]:
    found, line, line_start, position = [], 1, 0, 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise LeanSyntaxError(f"line {line}: cannot read {text[position:position + 20]!r}")
        kind, value = match.lastgroup, match.group()
        if kind == "name" and value in KEYWORDS:
            kind = "keyword"
        if kind == "name" and value == "λ":
            raise LeanSyntaxError(f"line {line}: `λ` is outside the subset; write `fun`")
        if kind not in ("space",):
            found.append(Token(kind, value, line, position - line_start + 1))
        line += value.count("\n")
        if "\n" in value:
            line_start = position + value.rindex("\n") + 1
        position = match.end()
    return found


class Parser:
    """Recursive descent over the tokens of a term, a header or a generated module."""

    def __init__(self, text: str):
        self.tokens = tokens(text)
        self.position = 0

    # -- tokens --
    def peek(self, skip_newlines: bool = True) -> Token | None:
        position = self.position
        while position < len(self.tokens):
            token = self.tokens[position]
            if token.kind in ("comment", "block") or (skip_newlines and token.kind == "newline"):
                position += 1
                continue
            return token
        return None

    def next(self) -> Token:
        token = self.peek()
        if token is None:
            raise LeanSyntaxError("unexpected end of text")
        self.position = self.tokens.index(token, self.position) + 1
        return token

    def at(self, text: str) -> bool:
        token = self.peek()
        return token is not None and token.text == text and token.kind in ("symbol", "keyword")

    def expect(self, text: str) -> Token:
        token = self.next()
        if token.text != text:
            raise LeanSyntaxError(f"line {token.line}:{token.column}: expected `{text}`, "
                                  f"found `{token.text}`")
        return token

    def error(self, what: str) -> LeanSyntaxError:
        token = self.peek()
        where = f"line {token.line}:{token.column}, at `{token.text}`" if token else "the end"
        return LeanSyntaxError(f"{where}: {what}")

    # -- terms --
    def term(self, at_least: int = 0) -> Term:
        if self.at("fun"):
            self.next()
            binders = self.binders(until="=>")
            self.expect("=>")
            return Fun(binders, self.term())
        if self.at("∀"):
            self.next()
            binders = self.binders(until=",")
            self.expect(",")
            return Forall(binders, self.term())
        if self.at("if"):
            self.next()
            condition = self.term()
            self.expect("then")
            then = self.term()
            self.expect("else")
            return Ite(condition, then, self.term())
        pi = self.pi_binder()
        if pi is not None:
            self.expect("→")
            return Pi(pi, self.term())
        if self.at("¬") or self.at("-"):
            op = self.next().text
            left = Prefix(op, self.term(PREFIX[op]))
        else:
            left = self.application()
        while True:
            token = self.peek()
            if token is None or token.kind != "symbol" or token.text not in INFIX:
                return left
            level, side = INFIX[token.text]
            if level < at_least:
                return left
            self.next()
            right = self.term(level if side == "right" else level + 1)
            left = Binary(token.text, left, right)

    def pi_binder(self) -> Binder | None:
        """A binder followed by `→`, or None (the position is then unchanged)."""
        token = self.peek()
        if token is None or token.text not in ("(", "{", "["):
            return None
        start = self.position
        try:
            binder = self.bracketed_binder()
        except LeanSyntaxError:
            binder = None
        if binder is not None and self.at("→") and (binder.names or binder.bracket != "("):
            return binder
        self.position = start
        return None

    def starts_argument(self) -> bool:
        token = self.peek()
        return token is not None and (token.kind in ("name", "num", "ctor")
                                      or token.text in ("(", "⟨", "_", "@"))

    def application(self) -> Term:
        fn = self.argument()
        args = []
        while self.starts_argument():
            args.append(self.argument())
        return App(fn, tuple(args)) if args else fn

    def argument(self) -> Term:
        token = self.next()
        if token.kind == "name" or token.text == "_":
            term = Name(token.text)
        elif token.text == "@":
            term = Name("@" + self.next().text)
        elif token.kind == "num":
            term = Num(int(token.text))
        elif token.kind == "ctor":
            term = Ctor(token.text[1:])
        elif token.text == "(":
            inner = self.term()
            if self.at(":"):
                self.next()
                inner = Typed(inner, self.term())
            self.expect(")")
            term = inner
        elif token.text == "⟨":
            items = [self.term()]
            while self.at(","):
                self.next()
                items.append(self.term())
            self.expect("⟩")
            term = Anonymous(tuple(items))
        else:
            raise LeanSyntaxError(f"line {token.line}:{token.column}: a term cannot start with "
                                  f"`{token.text}`")
        while True:
            after = self.peek()
            if after is None or after.kind != "field":
                return term
            self.next()
            term = Field(term, after.text[1:])

    def bracketed_binder(self) -> Binder:
        bracket = self.next().text
        close = {"(": ")", "{": "}", "[": "]"}[bracket]
        names = []
        if bracket == "[":
            binder = Binder((), self.term(), "[")
            self.expect("]")
            return binder
        while (token := self.peek()) is not None and (token.kind == "name" or token.text == "_"):
            names.append(self.next().text)
        if not names:
            raise self.error("a binder needs a name")
        self.expect(":")
        binder = Binder(tuple(names), self.term(), bracket)
        self.expect(close)
        return binder

    def binders(self, until: str) -> tuple[Binder, ...]:
        """The binders of `fun`/`∀` (up to `until`) or of a header (up to `:`)."""
        found = []
        while not self.at(until):
            token = self.peek()
            if token is None:
                raise self.error(f"expected `{until}`")
            if token.text in ("(", "{", "["):
                found.append(self.bracketed_binder())
            elif token.kind == "name" or token.text == "_":
                names = [self.next().text]
                while (more := self.peek()) is not None and (more.kind == "name" or more.text == "_"):
                    names.append(self.next().text)
                kind = None
                if self.at(":") and until != ":":
                    self.next()
                    kind = self.term()
                found.append(Binder(tuple(names), kind))
            else:
                raise self.error("expected a binder")
        return tuple(found)

    def done(self) -> None:
        if self.peek() is not None:
            raise self.error("unexpected text after the term")


def parse_term(text: str) -> Term:
    parser = Parser(text)
    term = parser.term()
    parser.done()
    return term


def parse_signature(text: str) -> tuple[tuple[Binder, ...], Term | None]:
    """A declaration header after its name: `binders : type`, the type absent for an `abbrev`."""
    parser = Parser(text)
    binders = []
    while (token := parser.peek()) is not None and token.text in ("(", "{", "["):
        binders.append(parser.bracketed_binder())
    if parser.peek() is None:
        return tuple(binders), None
    parser.expect(":")
    type_ = parser.term()
    parser.done()
    return tuple(binders), type_


def parse_module(text: str) -> Module:
    """A file in the form `print_module` writes; anything else is a `LeanSyntaxError`."""
    lines = text.split("\n")
    header = []
    while lines and lines[0].startswith("-- "):
        header.append(lines.pop(0)[3:])
    parser = Parser("\n".join(lines))
    imports, opens, items, namespace, ended = [], [], [], None, False
    doc, comment = "", ""
    while parser.position < len(parser.tokens):
        raw = parser.tokens[parser.position]
        if raw.kind in ("newline", "comment", "block"):
            parser.position += 1
            if raw.kind == "comment":
                comment = raw.text[2:].strip()
            elif raw.kind == "block" and raw.text.startswith("/-!"):
                items.append(Section(raw.text[3:-2].strip()))
            elif raw.kind == "block" and raw.text.startswith("/--"):
                doc = raw.text[3:-2].strip()
            elif raw.kind == "block":
                raise LeanSyntaxError(f"line {raw.line}: a plain block comment is outside the subset")
            continue
        if ended:
            raise LeanSyntaxError(f"line {raw.line}: text after the namespace's end")
        keyword = parser.next()
        if keyword.text in ("import", "namespace", "open", "end"):
            name = parser.next().text
            if keyword.text == "import":
                imports.append(name)
            elif keyword.text == "open":
                opens.append(name)
            elif keyword.text == "namespace":
                namespace = name
            elif name != namespace:
                raise LeanSyntaxError(f"line {keyword.line}: `end {name}` closes no open namespace")
            else:
                ended = True
        elif keyword.text in ("def", "theorem"):
            items.append(_declaration(parser, keyword.text, doc, comment))
            doc, comment = "", ""
        else:
            raise LeanSyntaxError(f"line {keyword.line}:{keyword.column}: `{keyword.text}` is "
                                  "outside the subset pyml emits")
    if namespace is None or not ended:
        raise LeanSyntaxError("the file opens and closes no namespace")
    return Module(tuple(header), tuple(imports), namespace, tuple(opens), tuple(items))


def _declaration(parser: Parser, keyword: str, doc: str, comment: str) -> Declaration:
    name = parser.next()
    if name.kind != "name":
        raise LeanSyntaxError(f"line {name.line}: expected a declaration name, found `{name.text}`")
    binders = []
    while (token := parser.peek()) is not None and token.text in ("(", "{", "["):
        binders.append(parser.bracketed_binder())
    parser.expect(":")
    type_ = parser.term()
    if parser.at(":="):
        parser.next()
        body = parser.term()
        if keyword == "def":
            return Def(name.text, tuple(binders), type_, body, doc)
        return Theorem(name.text, tuple(binders), type_, body, doc, comment)
    if not parser.at("|") or keyword != "def" or binders:
        raise parser.error(f"expected `:=` after the type of {name.text}")
    alternatives = []
    while parser.at("|"):
        parser.next()
        patterns = [parser.term()]
        while parser.at(","):
            parser.next()
            patterns.append(parser.term())
        parser.expect("=>")
        alternatives.append((tuple(patterns), parser.term()))
    return MatchDef(name.text, type_, tuple(alternatives), doc)
