/-
pyml: the exact integer model of the layers, the laws their backward passes rest on, and the
typed layer-composition structure.

Pinned toolchain: `leanprover/lean4:v4.24.0` (see `lean-toolchain`). Core Lean only, no Mathlib.
Every core lemma, tactic and Lake option used here was looked up by its exact name and statement
in the Lean 4 sources (`leanprover/lean4`); `README.md` lists them and where each one lives.
-/
import PyML.Sum
import PyML.Model
import PyML.Laws
import PyML.Shape
import PyML.Examples
import PyML.Axioms
