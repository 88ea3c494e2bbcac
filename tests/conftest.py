"""What several test files share: the shipped Gemma 3 270M imported once per session.

pyml is imported first, before any test module imports torch or numpy: it puts its thread-pool
settings (`pyml.THREAD_POOL_ENVIRONMENT`) in the environment, which the OpenMP and OpenBLAS pools
read when they load. With torch loaded first, the real models' decode steps ran about 15x slower
here (0.18 against 2.9 tokens/s for Gemma 3 270M), which only costs the suite time.
"""

import pyml  # noqa: F401  (first: see above)

import pytest

from pyml.runtime.gemma3_gguf import SPEC_NAME, shipped_gguf_path
from pyml.runtime.gguf_import import import_gguf


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    """The folder `pyml import-gguf --shipped gemma3-270m` writes (about 20 s here)."""
    return import_gguf(shipped_gguf_path(), tmp_path_factory.mktemp("gemma") / "gemma3-270m",
                       progress=False, name=SPEC_NAME)
