import Lake
open Lake DSL

-- The pyml proofs: core Lean only, no dependencies, so `lake build` takes seconds.
package pyml

-- The exact model, the laws and their proofs (hand-written).
@[default_target]
lean_lib PyML

-- The per-spec theorem instances the generator emits under `Generated/`. The glob reads that
-- folder, so it must exist (it holds a `.gitkeep`); with no `.lean` file in it the library is empty.
@[default_target]
lean_lib Generated where
  globs := #[.submodules `Generated]
