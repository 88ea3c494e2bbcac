import Lake
open Lake DSL

-- pyml's laws: the exact model, the laws and their proofs. Core Lean only, no dependencies, so
-- `lake build` takes seconds. Projects require this package (`pyml init` writes one that does).
package pyml

@[default_target]
lean_lib PyML
