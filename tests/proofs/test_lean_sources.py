"""What CI can check of the Lean sources without a Lean toolchain: no unfinished proof, no new
axiom, every law's axioms printed by the build, the law index as expected, one pinned release."""

import re
import tomllib
from pathlib import Path

from pyml.laws import load_law_index
from pyml.project import LAWS_DIR, TEMPLATE_DIR
from tests.support.lean_core_names import core_names

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = re.compile(r"\b(sorry|admit|axiom)\b")
EXPECTED_LAWS = {
    "linear_input_adjoint", "linear_weight_adjoint_input", "linear_weight_adjoint_weight",
    "matmul_adjoint_left", "matmul_adjoint_right", "embedding_adjoint", "hadamard_adjoint",
    "residual_adjoint", "compose_adjoint", "rotation_adjoint", "smul_adjoint", "bias_adjoint",
    "chain_append_forward", "chain_adjoint", "chain_transposed_forward", "layer_param_grad_adjoint",
}


def lean_sources():
    return [p for p in LAWS_DIR.rglob("*.lean") if ".lake" not in p.parts]


def test_no_sorry_admit_or_axiom_in_lean_sources():
    offending = [f"{p.relative_to(LAWS_DIR)}:{n}: {line.strip()}"
                 for p in lean_sources()
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if FORBIDDEN.search(line)]
    assert not offending, "unfinished proofs or new axioms:\n" + "\n".join(offending)


def test_the_scan_catches_each_forbidden_word():
    for bad in ("  sorry", "theorem t : False := by admit", "axiom cheat : False"):
        assert FORBIDDEN.search(bad)
    assert not FORBIDDEN.search("#print axioms PyML.linear_input_adjoint")


def test_every_law_has_its_axioms_printed():
    printed = set()
    for p in lean_sources():
        printed |= set(re.findall(r"^#print axioms PyML\.(\w+)\s*$", p.read_text(encoding="utf-8"), re.M))
    assert set(load_law_index()) <= printed


def test_law_index_reads_the_expected_laws():
    index = load_law_index()
    assert set(index) == EXPECTED_LAWS
    law = index["linear_input_adjoint"]
    assert law.statement == ("{m n : Nat} (W : Mat m n) (g : Vec m) (v : Vec n) : "
                             "dot g (matVec W v) = dot (matTVec W g) v")
    assert law.source_file == "PyML/Laws.lean"
    assert law.description.startswith("linear layer, input side")
    assert len(law.sha256) == 64


def test_law_hash_follows_the_statement_not_its_layout(tmp_path):
    (tmp_path / "PyML").mkdir()
    one = "/-- law: x -/\ntheorem t (a : Int) :\n    a = a := rfl\n"
    two = "/-- law: x -/\ntheorem t (a : Int) : a = a :=\n  rfl\n"
    three = "/-- law: x -/\ntheorem t (a : Int) : a = a + 0 := rfl\n"
    hashes = []
    for text in (one, two, three):
        (tmp_path / "PyML" / "L.lean").write_text(text)
        hashes.append(load_law_index(tmp_path)["t"].sha256)
    assert hashes[0] == hashes[1] != hashes[2]


def test_one_pinned_stable_release():
    pin = (LAWS_DIR / "lean-toolchain").read_text().strip()
    assert re.fullmatch(r"leanprover/lean4:v4\.\d+\.\d+", pin), pin
    assert (LAWS_DIR / "lakefile.lean").is_file()


def test_this_checkouts_lean_package_is_a_project_like_any_other():
    """lean/ is the Lake package of the instances generated for specs/, set up as `pyml init`
    sets up a user's: the same lakefile, pyml's pin, and the folder its glob reads."""
    lean = ROOT / "lean"
    assert (lean / "lakefile.lean").read_text() == (TEMPLATE_DIR / "lean" / "lakefile.lean").read_text()
    assert (lean / "lean-toolchain").read_text() == (LAWS_DIR / "lean-toolchain").read_text()
    assert (lean / "Generated" / ".gitkeep").is_file()


def listed_core_names() -> dict[str, dict]:
    entries = tomllib.loads((LAWS_DIR / "core_names.toml").read_text(encoding="utf-8"))["name"]
    return {entry["used_as"]: entry for entry in entries}


def test_every_core_name_the_proofs_use_is_confirmed():
    """pyml/lean/core_names.toml lists every Lean core name lean/PyML uses and where it was confirmed;
    a proof that brings in another name fails here until it is looked up and listed."""
    listed = listed_core_names()
    used = core_names(LAWS_DIR)
    unlisted = {name: sorted(files) for name, files in used.items() if name not in listed}
    assert not unlisted, f"core names used but not confirmed in lean/core_names.toml: {unlisted}"
    assert set(listed) <= set(used), f"listed but no longer used: {set(listed) - set(used)}"
    for entry in listed.values():
        assert entry["source"] and entry["declared"] and entry["statement"], entry


def test_the_core_name_scan_finds_a_new_name(tmp_path):
    (tmp_path / "PyML").mkdir()
    (tmp_path / "PyML" / "L.lean").write_text(
        "namespace PyML\n\ntheorem t (a b : Int) : a + b = b + a := by\n"
        "  intro\n  exact (Int.add_comm' a b).symm.trans rfl\n\nend PyML\n")
    used = core_names(tmp_path)
    assert {"Int.add_comm'", ".symm", ".trans", "rfl", "exact", "Int"} <= set(used)
    assert not {"a", "b", "t"} & set(used)
