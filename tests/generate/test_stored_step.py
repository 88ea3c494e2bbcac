"""Generation from a folder reads the weights where the folder stores them (pyml/generate/stored_step.py).

- The CPU step of an imported GGUF folder builds no float32 model: every row its linear maps and
  embedding read is in the memory map of the GGUF, and every array it keeps is a view of that map
  or small (the norm gains).
- Its greedy tokens equal the float32 model's (`--weights f32`), on a llama folder whose GGUF
  stores F32 rows, F16 rows and Q8_0 blocks.
- A weight type the kernels cannot read in place (Q5_1) runs on float32 rows of that tensor only.
"""

import mmap

import gguf
import numpy as np
import pytest

from pyml.formats.gguf_import import import_gguf
from pyml.generate import decoding
from pyml.generate.quantized import QuantizedDecoder
from pyml.generate.stored_step import StepModel
from tests.support.model_folders import LLAMA, write_gguf


def mapped_buffer(array: np.ndarray):
    """The memory map `array` is a view of, or None."""
    while array is not None and not isinstance(array, mmap.mmap):
        array = getattr(array, "base", None)
        if isinstance(array, memoryview):
            array = array.obj
    return array


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    """Llama folders of llama_tiny's dims: their GGUF's matrices stored F32, and F16/Q8_0/Q5_1
    (q and gate in Q8_0, the others F16, layer 1's down projection Q5_1)."""
    root = tmp_path_factory.mktemp("stored")
    folders = {}
    for name, types in (("f32", None), ("mixed", {"attn_q": gguf.GGMLQuantizationType.Q8_0,
                                                   "ffn_gate": gguf.GGMLQuantizationType.Q8_0,
                                                   "blk.1.ffn_down": gguf.GGMLQuantizationType.Q5_1,
                                                   "": gguf.GGMLQuantizationType.F16})):
        path = root / f"{name}.gguf"
        write_gguf(path, "llama", LLAMA, tensor_types=types)
        # both named as tiny_folder names the llama of these dims: one compiled package for all
        folders[name] = import_gguf(path, root / name, progress=False, name="tiny_llama")
    return folders


def greedy(model, ids, count=12):
    cache, logits = model.start_decoding(np.array([ids]), len(ids) + count)
    tokens = []
    for _ in range(count):
        tokens.append(int(np.argmax(logits[0])))
        logits = model.decode(cache, np.array([tokens[-1]]))
    return tokens


@pytest.mark.parametrize("name", ["f32", "mixed"])
def test_the_step_reads_every_weight_row_in_the_gguf(llama_folders, name):
    decoder = decoding.load_decoder(llama_folders[name])
    assert isinstance(decoder, QuantizedDecoder) and isinstance(decoder.model, StepModel)
    maps = {id(mapped_buffer(array)) for array in decoder.kept if mapped_buffer(array) is not None}
    assert len(maps) == 1, "every kept weight is a view of the GGUF's one memory map"
    gguf_map = mapped_buffer(next(array for array in decoder.kept if mapped_buffer(array) is not None))
    start = np.frombuffer(gguf_map, np.uint8).ctypes.data
    copied = [array for array in decoder.kept if mapped_buffer(array) is None]
    for prefix, (_, addresses, *_) in decoder.weights.items():
        inside = (addresses >= start) & (addresses < start + len(gguf_map))
        if name == "f32" or prefix not in ("mlp_down",):
            assert inside.all(), prefix
    if name == "mixed":  # Q5_1 has no in-place kernel: that one tensor's float32 rows
        assert [array.nbytes for array in copied] == [LLAMA["hidden"] * LLAMA["ffn"] * 4]
        assert decoder.formats["mlp_down"] == "F16/F32"
    else:
        assert not copied


@pytest.mark.parametrize("name", ["f32", "mixed"])
def test_greedy_tokens_equal_the_float32_models(llama_folders, name):
    ids = [5, 17, 23, 42, 8, 61, 3]
    stored = decoding.load_decoder(llama_folders[name])
    float32 = decoding.load_decoder(llama_folders[name], weights="f32")
    assert greedy(stored, ids) == greedy(float32, ids)


def test_every_linear_map_of_the_step_is_one_compiled_linear_stored(llama_folders):
    """The tied head is layer 0 of a model-level weight: passed as a literal 0, Numba compiled a
    second `linear_stored` into every step, 17 s of each cold start here. The step is typed afresh
    (a new dispatcher of its function), whatever Numba's cache already holds."""
    from numba import njit, types

    from pyml.package.decode_cpu import linear_stored

    decoder = decoding.load_decoder(llama_folders["f32"])
    greedy(decoder, [5, 17, 23], count=1)
    step = decoder.step.decode_step
    njit(step.py_func).compile(step.signatures[0])
    layers = {signature[1] for signature in linear_stored.signatures}
    assert layers and not [layer for layer in layers if isinstance(layer, types.Literal)], layers
