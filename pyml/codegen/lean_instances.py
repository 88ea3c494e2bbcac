"""The Lean file generated for a spec: its skeleton, and one instance of the laws per layer.

Everything is built as terms (`pyml.codegen.lean_syntax`) and printed by its one printer. An
instance is the law's own statement, parsed from the law index, with the spec's dims put in for
the law's dim variables; its proof is the law applied to its arguments. Because the statement is
the index's, a changed law changes every instance, and `pyml check` sees the drift. Dims that the
spec leaves open (the number of tokens T) stay variables.
"""

from __future__ import annotations

import re

from pyml import __version__
from pyml.codegen.ir import Graph, Instance, Link, Skeleton
from pyml.codegen.lean_syntax import (
    App,
    Binary,
    Binder,
    Ctor,
    Def,
    Field,
    Forall,
    Fun,
    MatchDef,
    Module,
    Name,
    Num,
    Pi,
    Section,
    Term,
    Theorem,
    apply,
    parse_signature,
    print_module,
)
from pyml.laws import Law, load_law_index

NIL = Ctor("nil")


def chain(links: tuple[Link, ...], rest: Term = NIL) -> Term:
    """The `Chain` term of `links` followed by `rest`: `.layer (Layer.gain 4) (.residual … rest)`."""
    for link in reversed(links):
        if link.kind == "residual":
            rest = apply(Ctor("residual"), chain(link.body), rest)
        else:
            layer = apply("Layer.dense" if link.kind == "dense" else "Layer.gain", *link.dims)
            rest = apply(Ctor("layer"), layer, rest)
    return rest


def skeleton_declarations(skeleton: Skeleton) -> list[Def | MatchDef]:
    chain_type = apply("Chain", *skeleton.dims)
    if not skeleton.n_blocks:
        return [Def("skeleton", (), chain_type, chain(skeleton.start))]
    width = skeleton.dims[0]
    block_type = apply("Chain", width, width)
    # skeleton = start, then `(blocks n).append end`
    blocks = App(Field(apply("blocks", skeleton.n_blocks), "append"), (chain(skeleton.end),))
    return [
        Def("block", (), block_type, chain(skeleton.block),
            "One decoder block: its layers' value path, composed as the spec composes them."),
        MatchDef("blocks", Binary("→", Name("Nat"), block_type), (
            ((Num(0),), NIL),
            ((Binary("+", Name("n"), Num(1)),), App(Field(Name("block"), "append"), (apply("blocks", "n"),))),
        ), "`n` blocks, each with its own weights in the model, composed with `Chain.append`."),
        Def("skeleton", (), chain_type, chain(skeleton.start, blocks)),
    ]


def substitute(term: Term, dims: dict[str, int]) -> Term:
    """`term` with each free name in `dims` replaced by its value."""
    if isinstance(term, Name):
        return Num(dims[term.text]) if term.text in dims else term
    if isinstance(term, App):
        return App(substitute(term.fn, dims), tuple(substitute(a, dims) for a in term.args))
    if isinstance(term, Field):
        return Field(substitute(term.receiver, dims), term.name)
    if isinstance(term, Binary):
        return Binary(term.op, substitute(term.left, dims), substitute(term.right, dims))
    if isinstance(term, (Fun, Forall)):
        binders = tuple(substitute_binder(b, dims) for b in term.binders)
        inner = {k: v for k, v in dims.items() if not any(k in b.names for b in term.binders)}
        return type(term)(binders, substitute(term.body, inner))
    if isinstance(term, Pi):
        inner = {k: v for k, v in dims.items() if k not in term.binder.names}
        return Pi(substitute_binder(term.binder, dims), substitute(term.body, inner))
    if isinstance(term, (Num, Ctor)):
        return term
    raise ValueError(f"a law statement holds a term instances cannot substitute into: {term!r}")


def substitute_binder(binder: Binder, dims: dict[str, int]) -> Binder:
    kind = substitute(binder.type, dims) if binder.type is not None else None
    return Binder(binder.names, kind, binder.bracket)


def instantiate(law: Law, instance: Instance) -> Theorem:
    binders, conclusion = parse_signature(law.statement)
    kept, arguments = [], []
    for binder in binders:
        if binder.bracket == "{" and binder.type == Name("Nat"):
            open_dims = tuple(name for name in binder.names if name not in instance.dims)
            if open_dims:
                kept.append(Binder(open_dims, binder.type, "{"))
            continue
        kept.append(substitute_binder(binder, instance.dims))
        if binder.explicit:
            arguments += binder.names
    return Theorem(f"{instance.layer}_{law.name}", tuple(kept), substitute(conclusion, instance.dims),
                   apply(law.name, *arguments), comment=instance.comment)


def module_name(spec) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", spec.name) if part)


def render(spec, graph: Graph, spec_path: str) -> tuple[str, str]:
    """(path relative to the project root, text) of the spec's Lean file: the graph's skeleton and
    every op's law instances."""
    index = load_law_index()
    skeleton = Name("skeleton")
    out_dim = graph.skeleton.dims[1]
    items = [
        Section("## The skeleton: it type-checks only where every junction's dims agree."),
        *skeleton_declarations(graph.skeleton),
        Theorem("skeleton_adjoint", (),
                apply("IsAdjoint", Field(skeleton, "forward"), Field(skeleton, "backward")),
                apply("chain_adjoint", skeleton),
                doc="The skeleton's backward map is the adjoint of its forward map."),
        Theorem("skeleton_backward_is_reversed", (Binder(("g",), apply("Vec", out_dim)),),
                Binary("=", apply(Field(Field(skeleton, "transposed"), "forward"), "g"),
                       apply(Field(skeleton, "backward"), "g")),
                apply("chain_transposed_forward", skeleton, "g"),
                doc="The backward pass is the reversed chain of transposed layers."),
        Section("## The laws at this spec's dims, one instance per layer"),
        *(instantiate(index[instance.law], instance)
          for op in graph.ops() for instance in op.instances),
    ]
    name = module_name(spec)
    module = Module(
        header=(f"Generated by pyml {__version__} from {spec_path}; do not edit "
                "(`pyml check` fails on drift).",),
        imports=("PyML",), namespace=f"Generated.{name}", opens=("PyML",), items=tuple(items))
    return f"lean/Generated/{name}.lean", print_module(module)
