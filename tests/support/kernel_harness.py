"""Kernels of (kind, context) blocks as a generated package would call them, for the kernel tests.

`load(target, blocks)` gives each block's kernels under its prefix, `{p}_forward`, `{p}_backward`
...: a kind rendered per op (`pyml.codegen.kinds`: `template`) from its rendered module, any other
as its shared kernel (pyml/package/<target>) with the block's constants bound, as the kind's
`kernels` says and the generated code passes them. The rendered module is written with the module
header and imported. The file goes to a fixed directory under the system temp dir, named by a hash of its
source and of the shared modules it imports, and written only when absent, so that Numba's
`cache=True` (keyed on the file's path and mtime) makes a second test run skip compilation. CUDA
modules must be loaded in a process that set NUMBA_ENABLE_CUDASIM=1 before numba.cuda was first
imported: see tests/cuda/test_cuda_sim.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from functools import partial
from pathlib import Path

from pyml.codegen.kinds import KINDS
from pyml.codegen.manifest import shared_hash
from pyml.codegen.render import SHARED_KERNEL_MODULES, render_kernel_module

CACHE_DIR = Path(tempfile.gettempdir()) / "pyml-kernel-tests"

# all kinds with small dims that are not multiples of any tile or block size
DIMS = dict(dim=24, hidden=40, vocab=50, n_heads=4, n_kv_heads=2, head_dim=8, classes=37)
# the options of the second variant of a kind (the first has the shipped models' values): RoPE
# bases other than 10000 (issue 17: a hard-coded base must fail), an attention scale other than
# 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar), an embedding scale of sqrt(dim) (Gemma)
ROPE_THETAS = {"rope": 50000.0, "rope_local": 10000.0}
ATTENTION_SCALES = {"attn": 1.0 / DIMS["head_dim"] ** 0.5, "attn_scaled": 0.3}
EMBEDDING_SCALES = {"tok": 1.0, "tok_scaled": DIMS["dim"] ** 0.5}
NORM_EPS = {"norm": 1e-5, "norm_offset": 1e-6, "q_norm": 1e-6, "k_norm": 1e-6}
UNIT_OFFSET = {"norm": False, "norm_offset": True, "q_norm": False, "k_norm": True}


def all_blocks(target: str) -> list[tuple[str, dict]]:
    d = DIMS
    heads = dict(n_heads=d["n_heads"], n_kv_heads=d["n_kv_heads"], head_dim=d["head_dim"])
    blocks = [
        ("linear", dict(p="fc_bias", in_features=d["dim"], out_features=d["hidden"], bias=True)),
        ("linear", dict(p="fc", in_features=d["dim"], out_features=d["hidden"], bias=False)),
        *[("embedding", dict(p=p, vocab_size=d["vocab"], dim=d["dim"], scale=scale))
          for p, scale in EMBEDDING_SCALES.items()],
        *[("rmsnorm", dict(p=p, dim=d["dim"], eps=NORM_EPS[p], unit_offset=UNIT_OFFSET[p]))
          for p in ("norm", "norm_offset")],
        *[("layernorm", dict(p=p, dim=d["dim"], eps=1e-5, bias=bias))
          for p, bias in (("layer_norm", True), ("layer_norm_unbiased", False))],
        # QK-norm: the query heads' without offset (Qwen3), the kv heads' with (Gemma 3)
        *[("head_rmsnorm", dict(p=p, n_heads=n_heads, head_dim=d["head_dim"], eps=NORM_EPS[p],
                                unit_offset=UNIT_OFFSET[p]))
          for p, n_heads in (("q_norm", d["n_heads"]), ("k_norm", d["n_kv_heads"]))],
        *[("rope", dict(p=p, head_dim=d["head_dim"], theta=theta, max_seq_len=32))
          for p, theta in ROPE_THETAS.items()],
        *[("attention", dict(p=p, **heads, scale=scale)) for p, scale in ATTENTION_SCALES.items()],
        ("swiglu", dict(p="mlp", dim=d["dim"], hidden=d["hidden"])),
        ("geglu", dict(p="geglu", dim=d["dim"], hidden=d["hidden"])),
        ("silu", dict(p="silu")),
        ("gelu", dict(p="gelu")),
        ("relu", dict(p="relu")),
        ("loss", dict(p="ce", classes=d["classes"])),
    ]
    return blocks


class Kernels:
    """A rendered kernel module, and the shared kernels bound to each block's prefix."""

    def __init__(self, module, bound: dict):
        self.module, self.bound = module, bound

    def __getattr__(self, name):
        return self.bound[name] if name in self.bound else getattr(self.module, name)


def load(target: str, blocks: list[tuple[str, dict]]) -> Kernels:
    module = load_module(target, blocks)
    bound = {f"{context['p']}_{suffix}": partial(getattr(module, name), **constants)
             for kind, context in blocks if not KINDS[kind].template
             for suffix, (name, constants) in KINDS[kind].kernels(context).items()
             if hasattr(module, name)}  # rope_tables: the model fills the tables on the host
    return Kernels(module, bound)


def load_module(target: str, blocks: list[tuple[str, dict]]):
    source = render_kernel_module(target, blocks)
    # the shared modules the header imports are part of the name: Numba's cache of a module whose
    # own text did not change would otherwise keep what an edited shared module compiled to
    key = source + shared_hash(SHARED_KERNEL_MODULES[target])
    name = f"kernels_{target}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"{name}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{id(source)}.tmp")
        tmp.write_text(source, encoding="utf-8")
        tmp.replace(path)  # atomic, so a concurrent run never imports half a file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
