"""A check of emitted Lean that runs without Lean: every name exists, every application has its arity.

No Lean toolchain can be installed on the machines that run pyml's CI, so `lake build` never sees
the files `pyml gen` writes there. This check reads them with `pyml.codegen.lean_syntax`'s parser
and resolves every name against the file's own declarations, its binders and the declarations of
`lean/PyML` (read from their sources, as the law index is), and counts every application's
explicit arguments against the declaration it applies. It catches text that Lean would misparse
(`.layer a .nil.append (b).append c` is `.layer` applied to four arguments), a name that does not
exist, a constructor of the wrong type, and an argument left out or added. It does not check types
beyond the head of each argument's expected type, elaborate implicit arguments or check a proof:
only `lake build` (`make prove`) does that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pyml import project
from pyml.codegen.lean_syntax import (
    Anonymous,
    App,
    Binary,
    Binder,
    Ctor,
    Def,
    Field,
    Forall,
    Fun,
    Ite,
    MatchDef,
    Module,
    Name,
    Num,
    Pi,
    Prefix,
    Section,
    Term,
    Typed,
    parse_module,
    parse_signature,
    print_term,
)


@dataclass(frozen=True)
class Signature:
    """A declaration's name (inside the `PyML` namespace, or the generated file's), its header and
    what it is: "def", "abbrev", "theorem", "inductive", "constructor" or "core"."""

    name: str
    binders: tuple[Binder, ...]
    type: Term | None
    kind: str
    constructors: tuple[str, ...] = ()

    def explicit(self) -> tuple[list[Term | None], Term | None]:
        """The types of its explicit parameters, in order, and its type after all of them."""
        params = [b.type for b in self.binders if b.explicit for _ in b.names]
        rest = self.type
        while True:
            if isinstance(rest, Pi):
                if rest.binder.explicit:
                    params += [rest.binder.type] * len(rest.binder.names)
                rest = rest.body
            elif isinstance(rest, Binary) and rest.op == "→":
                params.append(rest.left)
                rest = rest.right
            else:
                return params, rest


# Core Lean names that emitted files may use, with their explicit arities.
CORE = {
    "Nat": Signature("Nat", (), Name("Type"), "core"),
    "Int": Signature("Int", (), Name("Type"), "core"),
    "Prop": Signature("Prop", (), Name("Type"), "core"),
    "Type": Signature("Type", (), None, "core"),
    "Fin": Signature("Fin", (Binder(("n",), Name("Nat")),), Name("Type"), "core"),
}

_DECLARATION = re.compile(
    r"^(?:@\[[^\]]*\]\s*)?(?:(?:private|protected|noncomputable)\s+)*"
    r"(?P<kind>def|abbrev|theorem|inductive)\s+(?P<name>[^\s:({\[]+)", re.MULTILINE)
_NAMESPACE = re.compile(r"^(namespace|end)\s+(\S+)", re.MULTILINE)
_CONSTRUCTOR = re.compile(r"^\s+\|\s*(?P<name>[^\s:({\[]+)(?P<header>[^\n]*)$", re.MULTILINE)
# a header ends at its `:=`, at `where` (an inductive), or at a match alternative's line
_HEADER_END = re.compile(r":=|\bwhere\b|\n\s*\|")


def _strip_comments(text: str) -> str:
    """Comments replaced by spaces of the same length, so positions stay where they were."""
    blank = lambda match: re.sub(r"[^\n]", " ", match.group())  # noqa: E731
    return re.sub(r"--[^\n]*", blank, re.sub(r"/-.*?-/", blank, text, flags=re.DOTALL))


def load_environment(lean_dir: Path | None = None) -> dict[str, Signature]:
    """Every declaration under `lean_dir/PyML` (default: pyml's laws), by its name inside the
    `PyML` namespace."""
    found: dict[str, Signature] = {}
    for path in sorted((Path(lean_dir or project.LAWS_DIR) / "PyML").rglob("*.lean")):
        text = _strip_comments(path.read_text(encoding="utf-8"))
        namespaces = [(m.start(), m[1], m[2]) for m in _NAMESPACE.finditer(text)]
        for match in _DECLARATION.finditer(text):
            prefix = _namespace_at(namespaces, match.start())
            end = _HEADER_END.search(text, match.end())
            header = text[match.end(): end.start() if end else len(text)]
            try:
                binders, type_ = parse_signature(header)
            except ValueError as error:
                line = text.count("\n", 0, match.start()) + 1
                raise ValueError(f"{path.name}:{line}: cannot read the header of "
                                 f"{match['name']}: {error}") from None
            name = _local_name(prefix, match["name"])
            constructors = ()
            if match["kind"] == "inductive":
                body_end = _DECLARATION.search(text, end.end())
                body = text[end.end(): body_end.start() if body_end else len(text)]
                body = body[: re.search(r"^\S", body, re.MULTILINE).start()] if re.search(
                    r"^\S", body, re.MULTILINE) else body
                for ctor in _CONSTRUCTOR.finditer(body):
                    ctor_binders, ctor_type = parse_signature(ctor["header"])
                    found[f"{name}.{ctor['name']}"] = Signature(
                        f"{name}.{ctor['name']}", ctor_binders, ctor_type, "constructor")
                    constructors += (ctor["name"],)
            found[name] = Signature(name, binders, type_, match["kind"], constructors)
    return found


def _namespace_at(namespaces, position: int) -> str:
    stack: list[str] = []
    for start, keyword, name in namespaces:
        if start > position:
            break
        if keyword == "namespace":
            stack.append(name)
        elif stack and stack[-1] == name:
            stack.pop()
    return ".".join(stack)


def _local_name(namespace: str, name: str) -> str:
    """A name as `open PyML` lets a generated file write it."""
    full = f"{namespace}.{name}" if namespace else name
    return full.removeprefix("PyML.")


def head(type_: Term | None) -> str | None:
    """The constant a type is an application of: `Chain 640 640` -> "Chain"."""
    if isinstance(type_, Name):
        return type_.text
    if isinstance(type_, App):
        return head(type_.fn)
    if isinstance(type_, Binary) and type_.op in ("×", "→"):
        return type_.op
    return None


class LeanCheckError(ValueError):
    pass


class Checker:
    """Resolves and counts one module's terms; `problems` collects what it finds."""

    def __init__(self, environment: dict[str, Signature], where: str):
        self.globals = {**CORE, **environment}
        self.where = where
        self.problems: list[str] = []
        self.declaration = ""
        self.own: set[str] = set()  # the module's own declarations, so far

    def problem(self, message: str, term: Term) -> None:
        text = print_term(term)
        text = text if len(text) <= 90 else text[:87] + "..."
        self.problems.append(f"{self.where}: {self.declaration}: {message}: `{text}`")

    # -- names --
    def constructor(self, name: str, expected: str | None, term: Term) -> Signature | None:
        if expected is not None:
            owner = self.globals.get(expected)
            if owner is None or owner.kind != "inductive":
                self.problem(f"`.{name}` where a `{expected}` is expected, which has no "
                             "constructors", term)
                return None
            if name not in owner.constructors:
                self.problem(f"`{expected}` has no constructor `{name}` (it has "
                             f"{', '.join(owner.constructors)})", term)
                return None
            return self.globals[f"{expected}.{name}"]
        owners = [sig for sig in self.globals.values()
                  if sig.kind == "inductive" and name in sig.constructors]
        if len(owners) != 1:
            self.problem(f"`.{name}` is a constructor of {len(owners)} types here: the expected "
                         "type is needed to tell which", term)
            return None
        return self.globals[f"{owners[0].name}.{name}"]

    def field(self, receiver_type: Term | None, name: str, term: Term) -> Signature | None:
        owner = head(receiver_type)
        if owner is None:
            self.problem(f"cannot tell the type of the term whose `.{name}` is taken", term)
            return None
        found = self.globals.get(f"{owner}.{name}")
        if found is None:
            self.problem(f"`{owner}` has no `{name}`", term)
        return found

    def reference(self, text: str, locals_: dict, term: Term):
        """(signature or None for a local, whether a receiver fills its first explicit parameter,
        the receiver's type) of a possibly dotted name."""
        if text in locals_ or text == "_":
            return None, False
        if text in self.globals:
            return self.globals[text], False
        parts = text.split(".")
        for split in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:split])
            if prefix in locals_:
                receiver = locals_[prefix]
            elif prefix in self.globals and not self.globals[prefix].explicit()[0]:
                receiver = self.globals[prefix].explicit()[1]
            else:
                continue
            sig = None
            for index, name in enumerate(parts[split:]):
                sig = self.field(receiver, name, term)
                if sig is None:
                    return "error", False
                if index < len(parts) - split - 1:
                    receiver = self.applied(sig, 1, term)
            return sig, True
        self.problem(f"unknown name `{text}`", term)
        return "error", False

    def applied(self, sig: Signature, given: int, term: Term) -> Term | None:
        """The type of `sig` applied to `given` explicit arguments; a problem unless that is all."""
        params, result = sig.explicit()
        if given != len(params):
            self.problem(f"`{sig.name}` takes {len(params)} explicit argument"
                         f"{'' if len(params) == 1 else 's'}, given {given}", term)
        return result

    # -- terms --
    def infer(self, term: Term, expected: str | None, locals_: dict) -> Term | None:
        """Check `term` where a value whose type's head is `expected` is wanted; its type if known."""
        if isinstance(term, Num):
            return None
        if isinstance(term, (Name, Ctor, Field)):
            return self.application(term, (), expected, locals_, bare=True)
        if isinstance(term, App):
            return self.application(term.fn, term.args, expected, locals_, bare=False, whole=term)
        if isinstance(term, Binary):
            self.infer(term.left, None, locals_)
            self.infer(term.right, None, locals_)
            return None
        if isinstance(term, Prefix):
            self.infer(term.operand, None, locals_)
            return None
        if isinstance(term, (Pi, Fun, Forall)):
            inner = dict(locals_)
            for binder in (term.binder,) if isinstance(term, Pi) else term.binders:
                self.binder(binder, inner)
            self.infer(term.body, None, inner)
            return None
        if isinstance(term, Ite):
            for part in (term.condition, term.then, term.otherwise):
                self.infer(part, None, locals_)
            return None
        if isinstance(term, Anonymous):
            for item in term.items:
                self.infer(item, None, locals_)
            return None
        if isinstance(term, Typed):
            self.infer(term.type, None, locals_)
            self.infer(term.term, head(term.type), locals_)
            return term.type
        raise LeanCheckError(f"not a term: {term!r}")

    def application(self, fn: Term, args: tuple, expected, locals_: dict, bare: bool,
                    whole: Term | None = None) -> Term | None:
        whole = whole or fn
        receiver_consumed = False
        if isinstance(fn, Name):
            sig, receiver_consumed = self.reference(fn.text, locals_, whole)
            if sig is None and fn.text in locals_ and not args:
                return locals_[fn.text]
        elif isinstance(fn, Ctor):
            sig = self.constructor(fn.name, expected, whole) or "error"
        elif isinstance(fn, Field):
            receiver_type = self.infer(fn.receiver, None, locals_)
            if fn.name.isdigit():
                if args:
                    self.problem("a projection applied to arguments", whole)
                if not (isinstance(receiver_type, Binary) and receiver_type.op == "×"):
                    self.problem(f"`.{fn.name}` of a term that is not known to be a pair", whole)
                    return None
                return receiver_type.left if fn.name == "1" else receiver_type.right
            sig = self.field(receiver_type, fn.name, whole) or "error"
            receiver_consumed = True
        else:
            self.problem("only a name, a constructor or a field is applied in emitted Lean", whole)
            sig = "error"
        if sig is None or sig == "error":  # a local function, or a problem already reported
            for arg in args:
                self.infer(arg, None, locals_)
            return None
        params, result = sig.explicit()
        params = params[1:] if receiver_consumed else params
        if bare and params:
            if isinstance(fn, Ctor):
                self.problem(f"`{sig.name}` takes {len(params)} explicit arguments, given 0", whole)
            return None  # the function itself, as in `IsAdjoint skeleton.forward ...`
        if len(args) != len(params):
            self.problem(f"`{sig.name}` takes {len(params)} explicit argument"
                         f"{'' if len(params) == 1 else 's'}"
                         f"{' after its receiver' if receiver_consumed else ''}, given {len(args)}",
                         whole)
        for index, arg in enumerate(args):
            self.infer(arg, head(params[index]) if index < len(params) else None, locals_)
        return result

    def binder(self, binder: Binder, locals_: dict) -> None:
        if binder.type is not None:
            self.infer(binder.type, None, locals_)
        for name in binder.names:
            locals_[name] = binder.type

    def pattern_names(self, pattern: Term, locals_: dict) -> None:
        """Bind the names of a match pattern that are not constructors or constants."""
        if isinstance(pattern, Name) and pattern.text not in self.globals:
            locals_[pattern.text] = None
        elif isinstance(pattern, Binary):
            self.pattern_names(pattern.left, locals_)
            self.pattern_names(pattern.right, locals_)
        elif isinstance(pattern, App):
            for arg in pattern.args:
                self.pattern_names(arg, locals_)

    # -- declarations --
    def module(self, module: Module, lean_dir: Path) -> None:
        self.declaration = "header"
        for name in module.imports:
            if not (Path(lean_dir) / (name.replace(".", "/") + ".lean")).is_file():
                self.problems.append(f"{self.where}: imports `{name}`, which is not in {lean_dir}")
        if "PyML" not in module.opens:
            self.problems.append(f"{self.where}: does not `open PyML`")
        for item in module.items:
            if isinstance(item, Section):
                continue
            self.declaration = item.name
            if item.name in self.own:
                self.problems.append(f"{self.where}: `{item.name}` is declared twice")
            locals_: dict = {}
            for binder in getattr(item, "binders", ()):
                self.binder(binder, locals_)
            self.infer(item.type, None, locals_)
            sig = Signature(item.name, getattr(item, "binders", ()), item.type,
                            "theorem" if not isinstance(item, (Def, MatchDef)) else "def")
            self.globals[item.name] = sig
            self.own.add(item.name)
            params, result = sig.explicit()
            if isinstance(item, MatchDef):
                for patterns, body in item.alternatives:
                    inner = dict(locals_)
                    if len(patterns) != len(params):
                        self.problem(f"an alternative of {len(patterns)} patterns for "
                                     f"{len(params)} explicit parameters", body)
                    for pattern in patterns:
                        self.pattern_names(pattern, inner)
                    self.infer(body, head(result), inner)
            else:
                body = item.body if isinstance(item, Def) else item.proof
                self.infer(body, head(item.type) if isinstance(item, Def) else None, locals_)


def check_text(text: str, where: str, environment: dict[str, Signature] | None = None,
               lean_dir: Path | None = None) -> list[str]:
    """The problems of one emitted file: a syntax error, or names and arities that do not resolve,
    against the Lean package in `lean_dir` (default: pyml's laws), whose declarations
    `environment` holds if given."""
    lean_dir = Path(lean_dir or project.LAWS_DIR)
    environment = environment if environment is not None else load_environment(lean_dir)
    try:
        module = parse_module(text)
    except ValueError as error:
        return [f"{where}: {error}"]
    checker = Checker(environment, where)
    checker.module(module, lean_dir)
    return checker.problems
