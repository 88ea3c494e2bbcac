"""What every generated package is built on: shared model classes and spec-independent kernels."""
