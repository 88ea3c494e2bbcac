"""What every generated package is built on: shared model classes and spec-independent kernels.

Imported before any generated module declares a cached kernel, so Numba's cache is keyed by the
module name from the first declaration on (see `numba_cache`)."""

from pyml.package import compile_notice  # noqa: F401  (says on stderr when a first use compiles)
from pyml.package import numba_cache  # noqa: F401  (keys Numba's cache by module name on import)
