import Lake
open Lake DSL

-- The theorem instances `pyml gen` writes under Generated/ for this project's specs, built
-- against pyml's laws. `pyml prove` copies the laws of the installed pyml into .pyml-laws/
-- before it builds, so they are the ones the generated code was checked against.
package pyml_project

require pyml from "."/".pyml-laws"

-- The glob reads Generated/, which must exist (it holds a .gitkeep).
@[default_target]
lean_lib Generated where
  globs := #[.submodules `Generated]
