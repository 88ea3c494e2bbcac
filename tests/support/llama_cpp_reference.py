"""llama.cpp, through llama-cpp-python (`make test` builds it: an anchor, tests/support/anchors.py),
as the reference for what our GGUF exports mean to llama.cpp: the check that neither transformers
nor our own importer can make."""

from pathlib import Path

import numpy as np
import torch

from pyml.formats.gguf_export import export_gguf
from tests.support import anchors
from tests.support.model_folders import transformers_folder


def llama_cpp_module():
    """llama-cpp-python's `llama_cpp`: the Makefile pins its version and builds it."""
    return anchors.module("llama_cpp", "`make llama-cpp-python` builds it")


def assert_llama_cpp_logits_equal_transformers(folder: Path, tmp_path: Path, ids: list[int]) -> None:
    """llama.cpp running our f32 export of `folder` gives transformers' logits on the folder for
    `ids`, with a float32 KV cache (its default float16 cache alone differs by about 1e-3)."""
    llama_cpp = llama_cpp_module()
    from transformers import AutoModelForCausalLM

    exported = export_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    runner = llama_cpp.Llama(str(exported), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                             type_k=0, type_v=0, flash_attn=False)  # GGML_TYPE_F32 keys and values
    runner.eval(ids)
    reference = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.array(runner.scores[:len(ids)]), expected, rtol=1e-4, atol=1e-4)
