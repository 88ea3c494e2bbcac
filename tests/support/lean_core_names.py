"""The Lean core names that the hand-written proofs in lean/PyML use.

A name counts as core when it is neither declared under lean/PyML, nor bound in the declaration
that uses it (a binder, `fun`, `∀`, `intro`, `have`, `by_cases`, a match pattern), nor a keyword
of Lean's syntax. Field notation counts by its field: `h.symm` uses `.symm`, unless the field is
one of lean/PyML's own (`C.forward`). Each is spelled as the source spells it: `Int.add_comm`,
`congrArg`, `.symm`, `omega`.
"""

from __future__ import annotations

import re
from pathlib import Path

from pyml.codegen.lean_check import _strip_comments, load_environment

IDENT = r"[^\W\d][\w'!?₀-₉]*"
# the words of Lean's own syntax: commands, binders, term and tactic-block structure
SYNTAX = {"theorem", "def", "abbrev", "inductive", "where", "namespace", "end", "open", "import",
          "fun", "by", "if", "then", "else", "at", "with", "match", "print", "axioms", "_",
          "default_target", "calc"}

_BINDERS = [
    re.compile(rf"[({{⦃]\s*((?:{IDENT}\s+)*{IDENT})\s*:(?!=)"),  # (a b : T), {n : Nat}
    re.compile(rf"\bfun\s+((?:{IDENT}\s+)*{IDENT})\s*=>"),
    re.compile(rf"∀\s+((?:{IDENT}\s+)*{IDENT})\s*[:,]"),
    re.compile(rf"\bintro[ \t]+((?:{IDENT}[ \t]+)*{IDENT})"),
    re.compile(rf"\b(?:have|by_cases)\s+({IDENT})\s*:"),
]
_PATTERN = re.compile(r"^\s*\|(.*?)=>", re.MULTILINE)  # a match alternative's patterns
_NAMED_ARGUMENT = re.compile(rf"\(({IDENT})\s*:=")
_OCCURRENCE = re.compile(
    rf"(?P<field>(?<=[)⟩])(?:\.(?:{IDENT}|\d+))+)|(?P<name>{IDENT}(?:\.(?:{IDENT}|\d+))*)")
_DECLARATION_START = re.compile(r"^(?:theorem|def|abbrev|inductive)\b", re.MULTILINE)


def declarations(text: str) -> list[str]:
    """The text of each declaration (from its keyword to the next one) of a comment-free file."""
    starts = [m.start() for m in _DECLARATION_START.finditer(text)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def bound_names(declaration: str, declared: set[str]) -> set[str]:
    bound = set()
    for pattern in _BINDERS:
        for match in pattern.finditer(declaration):
            bound |= set(match.group(1).split())
    for match in _PATTERN.finditer(declaration):
        bound |= {name for name in re.findall(IDENT, match.group(1))
                  if name not in declared and not name.startswith("@")}
    return bound


def core_names(lean_dir: Path) -> dict[str, set[str]]:
    """{core name as spelled: the lean/PyML files that use it}."""
    environment = load_environment(lean_dir)
    declared = set(environment) | {name.split(".")[-1] for name in environment}
    own_fields = {name.split(".", 1)[1] for name in environment if "." in name}
    used: dict[str, set[str]] = {}
    for path in sorted((Path(lean_dir) / "PyML").rglob("*.lean")):
        text = _strip_comments(path.read_text(encoding="utf-8"))
        text = re.sub(r"^(?:import|namespace|end|open)\b[^\n]*", "", text, flags=re.MULTILINE)
        for declaration in declarations(text):
            header = re.match(rf"\w+\s+({IDENT}(?:\.{IDENT})*)", declaration)
            body = declaration[header.end():] if header else declaration
            bound = bound_names(body, declared)
            named = set(_NAMED_ARGUMENT.findall(body))
            for match in _OCCURRENCE.finditer(body):
                for name in _core_spellings(match, bound, named, declared, own_fields, environment):
                    used.setdefault(name, set()).add(path.name)
    return used


def _core_spellings(match, bound, named, declared, own_fields, environment):
    if match["field"]:
        return ["." + field for field in match["field"][1:].split(".")
                if field not in own_fields and not field.isdigit()]
    text = match["name"]
    parts = text.split(".")
    if text in environment or text in SYNTAX or text in named:
        return []
    if parts[0] in bound or parts[0] in declared and len(parts) > 1 and parts[0] in environment:
        # a local's (or a PyML constant's) fields
        return ["." + part for part in parts[1:] if part not in own_fields and not part.isdigit()]
    if parts[0] in bound or text in declared:
        return []
    return [text]
