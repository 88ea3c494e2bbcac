"""pyml as a tool: the CLI, the installed wheel, the package cache, the architecture of pyml's
imports."""
