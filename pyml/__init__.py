"""pyml: declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels that train it."""

import os

from pyml.cache import NUMBA, cache_dir

# Before anything of pyml runs: thread pools that spin briefly after their work, then sleep, also
# when torch or numpy were imported first (pyml/thread_pools.py says why and how). Generated
# packages and the CLI import pyml before numpy, numba or the kernels.
from pyml.thread_pools import THREAD_POOL_ENVIRONMENT, put_in_force, user_environment

put_in_force()
# Numba caches compiled code beside each source file unless told where: an installed pyml's
# folder is no place to write, so by default it goes under pyml's cache (pyml/cache.py).
os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir() / NUMBA))

__all__ = ["THREAD_POOL_ENVIRONMENT", "compile", "user_environment"]
__version__ = "0.1.0"


def compile(source):  # noqa: A001  (pyml.compile, as torch.compile: the builtin is untouched)
    """The generated package of a spec, as a module: `source` is a spec file (TOML) or a model
    folder holding spec.toml. A spec in a pyml project runs from the project's gen/ when that is
    up to date; any other is generated once into pyml's cache (PYML_CACHE, default
    ~/.cache/pyml) and imported from there.

        m = pyml.compile("my_decoder.toml")
        model = m.Model.initialized(seed=0)
        optimizer = m.AdamW(model, lr=1e-3)
        loss = m.train_step(model, optimizer, inputs, targets)
    """
    from pathlib import Path

    from pyml.packages import package_for

    return package_for(Path(source))
