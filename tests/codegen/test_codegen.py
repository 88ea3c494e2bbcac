"""The generator's links to the Lean laws, and the shape of what it emits."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

from pyml.codegen import render
from pyml.codegen.kinds import KINDS
from pyml.codegen.lean_instances import substitute
from pyml.codegen.lean_syntax import Binder, Name, parse_signature, parse_term, print_term
from pyml.codegen.lower import MODEL_LAWS, PIECE_LAWS
from pyml.laws import load_law_index

ROOT = Path(__file__).resolve().parents[2]
LAWS = load_law_index()


def test_every_law_the_generator_relies_on_is_stated_in_lean():
    relied_on = ({law for kind in KINDS.values() for law in kind.laws} | set(MODEL_LAWS)
                 | set(PIECE_LAWS))
    assert relied_on <= set(LAWS)


def kernel_sources(kind, target: str) -> str:
    """The text of the kind's kernels: its templates, or the shared modules that define them."""
    if kind.template:
        return render.template_path(target, kind.name).read_text()
    shared = importlib.import_module(f"pyml.package.{target}")
    context = {"bias": False, "scale": 1.0, "eps": 1e-6, "unit_offset": False, "theta": 1e4}
    kernels = [getattr(shared, name) for name, _ in kind.kernels(context).values()
               if hasattr(shared, name)]  # rope_tables: the model fills the tables on the host
    modules = {inspect.getmodule(getattr(kernel, "py_func", kernel)) for kernel in kernels}
    return "".join(inspect.getsource(module) for module in modules)


@pytest.mark.parametrize("target", render.TARGETS)
@pytest.mark.parametrize("kind", sorted(name for name, kind in KINDS.items() if kind.laws))
def test_each_kinds_kernels_name_the_laws_they_implement(target, kind):
    text = kernel_sources(KINDS[kind], target)
    assert set(re.findall(r"Lean law ([a-z_]+)", text)) <= set(LAWS), (
        f"{target}/{kind} names a law Lean does not state")
    if target == "cpu" or KINDS[kind].template:  # the shared CUDA kernels say "as the CPU's"
        mentioned = {law for law in LAWS if re.search(rf"\b{law}\b", text)}
        assert set(KINDS[kind].laws) <= mentioned


def test_a_law_instance_is_the_law_at_the_spec_dims():
    lean = (ROOT / "lean" / "Generated" / "MlpDigits.lean").read_text()
    assert (
        "theorem fc1_linear_input_adjoint (W : Mat 128 64) (g : Vec 128) (v : Vec 64) :\n"
        "    dot g (matVec W v) = dot (matTVec W g) v :=\n"
        "  linear_input_adjoint W g v"
    ) in lean
    assert "def skeleton : Chain 64 10 :=" in lean
    # the open dim (the number of tokens) stays a variable
    assert "theorem fc1_linear_weight_adjoint_weight {T : Nat} (G : Mat T 128) (X : Mat T 64)" in lean


def test_statement_parsing_and_substitution():
    binders, conclusion = parse_signature(LAWS["hadamard_adjoint"].statement)
    assert binders == (Binder(("n",), Name("Nat"), "{"), Binder(("g", "a", "b"), parse_term("Vec n")))
    assert substitute(conclusion, {"n": 7}) == conclusion  # no dim in the conclusion
    # a dim is replaced where it is a name, not inside other names (`n₁`, `fn`) or a bound variable
    term = parse_term("Vec n → Fin n₁ → fn n = (fun n => n) 1")
    assert print_term(substitute(term, {"n": 32})) == "Vec 32 → Fin n₁ → fn 32 = (fun n => n) 1"


def kernel_calls(source: str, function: str) -> list[str]:
    body = source.split(f"def {function}(", 1)[1].split("\n    def ", 1)[0]
    # a fused variant (`mlp_norm_forward_residual`, `attn_norm_backward_add`) counts as its layer
    return re.findall(r"k\.([a-z0-9_]+?)_(?:forward|backward)(?:_[a-z]+)?\(", body)


@pytest.mark.parametrize("package", ["mlp_digits", "llama_tiny"])
def test_generated_backward_is_the_forward_reversed(package):
    """The composition law made literal: the backward calls the forward's layers in reverse."""
    source = (ROOT / "gen" / package / "model.py").read_text()
    assert "def run_forward(self, s):\n        self.run_layers(s)\n" in source
    # a decoder's block runs in a method of its own, which the backward also calls (recompute)
    blocks = kernel_calls(source, "run_block") if "def run_block(" in source else []
    forward = kernel_calls(source, "run_layers") + blocks + kernel_calls(source, "run_forward")
    # the loss's fused forward and backward opens the backward pass
    backward = [name for name in kernel_calls(source, "run_loss_and_backward") if name != "loss"]
    assert forward and backward == forward[::-1]


@pytest.mark.parametrize("target", render.TARGETS)
def test_a_layer_with_the_dims_of_an_earlier_one_shares_its_kernels(target):
    """Same kind and dims: the later layer's names are bound to the earlier block's functions (its
    helpers stay private); other dims render a block of their own. Kinds whose kernels are shared
    render nothing at all."""
    dims = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "scale": 0.25}
    source = render.render_kernel_module(target, [
        ("attention", {"p": "attn", **dims}),
        ("attention", {"p": "local_attn", **dims}),
        ("attention", {"p": "wide_attn", **dims, "head_dim": 16}),
        ("rmsnorm", {"p": "norm", "dim": 24, "eps": 1e-5, "unit_offset": False}),
    ])
    assert "def local_attn_" not in source
    bindings = re.findall(r"^local_attn_(\w+) = attn_(\w+)$", source, re.MULTILINE)
    assert all(later == first for later, first in bindings)
    # the entry points the model calls, not the kernels and device helpers behind them
    assert {name for name, _ in bindings} >= {"forward", "backward", "decode"}
    assert "def wide_attn_forward(" in source
    assert "norm_" not in source.replace("rmsnorm_", "")
