"""The Lean side: the laws' Python mirror, the Lean sources, the emitted Lean, `pyml prove`, and
the kernels' bit-for-bit conformance to the exact model."""
