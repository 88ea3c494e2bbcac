"""The Lean pyml emits is well-formed: it parses, every name exists, every application has the
arity of what it applies (`pyml.codegen.lean_check`), and printing is parsing's inverse.

No Lean toolchain runs here; this is the check that does. It cannot see a type error that only
elaboration finds, nor a wrong proof: `make prove` (`lake build`) does that.
"""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyml.codegen import lean_instances
from pyml.codegen.lean_check import check_text, load_environment
from pyml.codegen.lean_syntax import (
    App,
    Binary,
    Ctor,
    Field,
    Name,
    Num,
    parse_module,
    parse_term,
    print_module,
    print_term,
)
from pyml.codegen.lower import lower
from pyml.spec import parse_spec
from tests.support.generator_fuzz import decoder_specs, sequential_specs

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = load_environment()
GENERATED = sorted((ROOT / "lean" / "Generated").glob("*.lean"))

BROKEN_SKELETON = """\
def skeleton : Chain 640 262144 :=
  .layer (Layer.gain 640) .nil.append (blocks 18).append (.layer (Layer.gain 640) (.layer (Layer.dense 640 262144) .nil))
"""
FIXED_SKELETON = """\
def skeleton : Chain 640 262144 :=
  .layer (Layer.gain 640) ((blocks 18).append (.layer (Layer.gain 640) (.layer (Layer.dense 640 262144) .nil)))
"""
BLOCKS = """\
def block : Chain 640 640 :=
  .layer (Layer.gain 640) .nil

def blocks : Nat → Chain 640 640
  | 0 => .nil
  | n + 1 => block.append (blocks n)
"""


def module_text(body: str) -> str:
    return f"-- a test module\nimport PyML\n\nnamespace Generated.Test\nopen PyML\n\n{body}\nend Generated.Test\n"


def problems(body: str) -> list[str]:
    return check_text(module_text(body), "Test.lean", ENVIRONMENT)


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_every_generated_file_is_well_formed_and_prints_back_as_it_is(path):
    text = path.read_text(encoding="utf-8")
    assert check_text(text, path.name, ENVIRONMENT) == []
    assert print_module(parse_module(text)) == text


def test_the_broken_gemma_skeleton_is_rejected_and_the_fixed_one_accepted():
    found = problems(BLOCKS + "\n" + BROKEN_SKELETON)
    assert any("`Chain.layer` takes 2 explicit arguments, given 4" in p for p in found), found
    assert any("no constructor `nil.append`" in p for p in found), found
    assert problems(BLOCKS + "\n" + FIXED_SKELETON) == []


@pytest.mark.parametrize("body, message", [
    ("def skeleton : Chain 4 4 :=\n  .layer (Layer.gain 4)\n", "takes 2 explicit arguments, given 1"),
    ("def skeleton : Chain 4 4 :=\n  .layer (Layer.gain 4 4) .nil\n", "`Layer.gain` takes 1 explicit argument, given 2"),
    ("def skeleton : Chain 4 4 :=\n  .layer (Layer.wide 4) .nil\n", "unknown name `Layer.wide`"),
    ("def skeleton : Chain 4 4 :=\n  .lyer (Layer.gain 4) .nil\n", "`Chain` has no constructor `lyer`"),
    ("def skeleton : Chain 4 4 :=\n  .layer .nil .nil\n", "`Layer` has no constructor `nil`"),
    ("theorem t (g : Vec 4) :\n    dot g = dot g g :=\n  hadamard_adjoint g g g\n", "`dot` takes 2 explicit arguments, given 1"),
    ("theorem t (g : Vec 4) :\n    skeleton.forward g = g :=\n  rfl\n", "unknown name `skeleton.forward`"),
    ("def skeleton : Chain 4 4 :=\n  .nil\n\ntheorem t : IsAdjoint skeleton.forwards skeleton.backward :=\n  chain_adjoint skeleton\n",
     "`Chain` has no `forwards`"),
])
def test_the_check_reports_each_kind_of_mistake(body, message):
    found = problems(body)
    assert any(message in p for p in found), found


def test_an_import_that_is_not_there_is_reported():
    text = module_text("def skeleton : Chain 4 4 :=\n  .nil\n").replace("import PyML", "import PyML.Nope")
    assert any("imports `PyML.Nope`" in p for p in check_text(text, "T.lean", ENVIRONMENT))


def test_the_environment_reads_every_declaration_of_lean_pyml():
    """The check resolves against every declaration header under lean/PyML, parsed, not guessed."""
    assert {"Chain.layer", "Layer.gain", "dot", "chain_adjoint", "sum_comm", "IsAdjoint"} <= set(ENVIRONMENT)
    assert ENVIRONMENT["Chain"].constructors == ("nil", "layer", "residual")
    params, result = ENVIRONMENT["Chain.append"].explicit()
    assert len(params) == 2 and print_term(result) == "Chain i k"


# -- the printer: every argument that is not atomic is parenthesised --------------------------------

NAMES = st.sampled_from(["a", "b", "g₁", "Layer.gain", "skeleton.forward"])
ATOMS = st.one_of(NAMES.map(Name), st.integers(0, 300).map(Num),
                  st.sampled_from(["nil", "layer"]).map(Ctor))


def extend(children):
    return st.one_of(
        st.tuples(st.one_of(NAMES.map(Name), st.sampled_from(["layer"]).map(Ctor)),
                  st.lists(children, min_size=1, max_size=3)).map(lambda t: App(t[0], tuple(t[1]))),
        st.tuples(children.filter(lambda t: not isinstance(t, Num)), st.sampled_from(["append", "1"]))
        .map(lambda t: Field(*t)),
        st.tuples(st.sampled_from(["=", "+", "→", "×", "*"]), children, children)
        .map(lambda t: Binary(*t)),
    )


TERMS = st.recursive(ATOMS, extend, max_leaves=12)


def dotted(term):
    """`Field(Name("a"), "f")` as Lean reads `a.f`: the dotted name `Name("a.f")`."""
    if isinstance(term, Field):
        receiver = dotted(term.receiver)
        if isinstance(receiver, Name) and not term.name.isdigit():
            return Name(f"{receiver.text}.{term.name}")
        return Field(receiver, term.name)
    if isinstance(term, App):
        return App(dotted(term.fn), tuple(dotted(a) for a in term.args))
    if isinstance(term, Binary):
        return Binary(term.op, dotted(term.left), dotted(term.right))
    return term


@settings(max_examples=300, deadline=None)
@given(TERMS)
def test_printing_then_parsing_gives_back_the_term(term):
    assert parse_term(print_term(term)) == dotted(term)


def test_an_application_argument_is_parenthesised():
    inner = App(Ctor("layer"), (App(Name("Layer.gain"), (Num(640),)), Ctor("nil")))
    outer = App(Ctor("layer"), (App(Name("Layer.gain"), (Num(640),)),
                                App(Field(App(Name("blocks"), (Num(18),)), "append"), (inner,))))
    assert print_term(outer) == (
        ".layer (Layer.gain 640) ((blocks 18).append (.layer (Layer.gain 640) .nil))")


# -- the generator on fuzzer-drawn specs --------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(decoder_specs(), sequential_specs()))
def test_the_lean_of_every_drawn_spec_is_well_formed(data):
    spec = parse_spec(data, "fuzz")
    path, text = lean_instances.render(spec, lower(spec), "specs/fuzz.toml")
    assert check_text(text, path, ENVIRONMENT) == []
    assert print_module(parse_module(text)) == text
