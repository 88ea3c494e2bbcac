"""pyml: declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels that train it."""

__version__ = "0.1.0"
