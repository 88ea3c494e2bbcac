"""Decoding on quantized weights through a package's decode step: gen/<name>/decode_cpu.py (the
fused step, one Numba call per token) on the CPU, gen/<name>/decode_cuda.py on device="cuda",
with the same weights copied to the GPU.

`pyml generate --weights` picks the weights the linear maps run on:

    as-stored  as the GGUF the folder was imported from stores them (`pyml import-gguf` keeps a copy,
               source.gguf): Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K stay quantized, also mixed across
               layers where their packed values have one width (a Q4_K_M file's Q4_K and Q6_K
               ffn_down); a linear op with a tensor of another type, or whose parts differ
               in type within a layer, runs on float32 rows. A folder without
               source.gguf (a training checkpoint) stores float32: as-stored is then f32.
    q8_0, q4_0, q4_1  every linear weight quantized from the folder's float32 weights by llama.cpp's
               reference quantizer (pyml.formats.quantize).
    f32        the float32 package's own decoding step, unchanged.

`pyml generate --activations` picks what the quantized weights multiply:

    f32        the float32 activations (the default): the products are the dequantized weights
               times x up to float32 summation order.
    q8_0       x rounded to int8 per 32 values first, as llama.cpp's CPU products do, and each
               block's product summed in integers (pyml/package/quantized_dot.py). Faster, and
               less exact: a product's relative error grows to about 5e-3, and greedy tokens may
               part from the float32 path's. Only Q4_0, Q4_1 and Q8_0 weights run it; the other
               formats keep float32 activations. CPU only.

On the CPU the prompt runs through the same step, PREFILL_CHUNK tokens of it per step
(`DecodingBatch`), so a prompt's keys and values are the step's own, whatever its length and
whatever runs beside it. On CUDA it runs through the float32 package's matrix-matrix forward
(prefill), whose keys and values seed the step's cache, on the same weights: as-stored, the
folder's float32 weights are the GGUF's dequantized (that is what import-gguf writes); quantized
from float32, the float32 model's linear weights are replaced by the dequantization of their
quantized blocks. Training never sees any of this: it loads the float32 folder.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from pyml.errors import PymlError
from pyml.formats.gguf_quantized import quantized_matrix
from pyml.formats.quant import GGMLType, dequantize
from pyml.formats.quantize import quantize
from pyml.package.base import BUFFER_SHAPES
from pyml.package.decode_cpu import (
    DENSE,
    Q4_RUNS_OF_16,
    Q4_RUNS_OF_16_X8,
    Q4_RUNS_OF_32,
    Q5,
    Q6,
    Q8,
    Q8_X8,
)
from pyml.package.quantized_dot import QDOT_GROUP_ROWS

WEIGHT_FORMATS = ("as-stored", "f32", "q8_0", "q4_0", "q4_1")
ACTIVATION_FORMATS = ("f32", "q8_0")
# the kinds that run on int8 activations instead, under --activations q8_0
INT8_ACTIVATION_KINDS = {Q4_RUNS_OF_16: Q4_RUNS_OF_16_X8, Q8: Q8_X8}
QUANTIZE_TO = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1}
# the fused step's kind (pyml/package/decode_cpu.py) of each type kept quantized
STEP_KINDS = {GGMLType.Q4_0: Q4_RUNS_OF_16, GGMLType.Q4_1: Q4_RUNS_OF_16,
              GGMLType.Q4_K: Q4_RUNS_OF_32, GGMLType.Q5_0: Q5, GGMLType.Q8_0: Q8,
              GGMLType.Q6_K: Q6}
# bytes of packed values per weight: layers of one op may differ in type where this agrees
PACKED_PER_VALUE = {GGMLType.Q4_0: 0.5, GGMLType.Q4_1: 0.5, GGMLType.Q4_K: 0.5, GGMLType.Q5_0: 0.5,
                    GGMLType.Q6_K: 0.5, GGMLType.Q8_0: 1}
# prompt tokens per step (DecodingBatch): a longer prompt is prefilled over several steps
PREFILL_CHUNK = 32


def check_weights(weights: str, activations: str = "f32") -> None:
    if weights not in WEIGHT_FORMATS:
        raise PymlError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    if activations not in ACTIVATION_FORMATS:
        raise PymlError(f"--activations must be one of {', '.join(ACTIVATION_FORMATS)}, not {activations!r}")
    if activations != "f32" and weights == "f32":
        raise PymlError(f"--activations {activations} rounds what quantized weights multiply: "
                        "it needs --weights other than f32")


def decode_module(model) -> ModuleType:
    """The decode step of `model`'s generated package for its device: decode_cpu or decode_cuda."""
    package = type(model).__module__.rsplit(".", 1)[0]
    name = f"{package}.decode_{model.device.name}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise PymlError(f"{package} has no fused decode step (a LoRA spec decodes in float32, and a "
                        f"package generated before it existed needs `pyml gen`): use --weights f32") from None


def weight_tuple(kinds: list[int], layers: list[dict[str, np.ndarray]], rows: int) -> tuple:
    """The step's (kinds, packed, high, scale, offset, dense): the kind of each layer, each array
    stacked (layers, rows, width), as wide as its widest layer (pyml/package/decode_cpu.py says
    why the padding is never read), width 0 where no layer has it. Dense rows keep the model's
    dtype."""
    arrays = []
    for name in ("packed", "high", "scale", "offset", "dense"):
        present = [layer[name] for layer in layers if name in layer]
        raw = name in ("packed", "high")
        dtype = np.uint8 if raw else present[0].dtype if present else np.float32
        width = max((array.shape[1] * array.dtype.itemsize // np.dtype(dtype).itemsize
                     for array in present), default=0)
        stacked = np.zeros((len(layers), rows, width), dtype)
        for index, layer in enumerate(layers):
            if name in layer:
                array = layer[name].view(np.uint8) if raw else layer[name]
                stacked[index, :, :array.shape[1]] = array
        arrays.append(stacked)
    return (np.array(kinds, np.int64), *arrays)


def rows_by_16(array: np.ndarray, per_block: int) -> np.ndarray:
    """A layer's (rows, width) array in quantized_dot's rows-by-16 order, flat per group of 16 rows
    (rows padded with zeros to a multiple of 16): per block of `per_block` elements of a row (16
    bytes of 4-bit values, 32 of 8-bit ones, or 1 scale), its runs of 4 bytes (of a scale: the
    scale), each run the 16 rows' in turn. (groups, 16 * width)."""
    rows, width = array.shape
    groups = -(-rows // QDOT_GROUP_ROWS)
    padded = np.zeros((groups * QDOT_GROUP_ROWS, width), array.dtype)
    padded[:rows] = array
    run = 4 if per_block > 1 else 1
    split = padded.reshape(groups, QDOT_GROUP_ROWS, width // per_block, per_block // run, run)
    return np.ascontiguousarray(split.transpose(0, 2, 3, 1, 4)).reshape(groups, -1)


def with_int8_activations(weight: tuple, columns: int) -> tuple:
    """`weight` (rows of `columns` values) with its Q4_0, Q4_1 and Q8_0 layers multiplying
    int8-rounded activations: their values, scales and offsets repacked rows by 16, the scales
    and offsets as float16 (the GGUF's own precision, so the bytes a token reads are the GGUF's),
    every array's rows padded to a multiple of 16 (the other kinds never read the padding). A
    layer's repacked group of 16 rows fills the start of that group's 16 stack rows, which is
    where the kernel reads it; a scale or offset stack that only those layers use is half as wide
    (float32 columns holding float16 pairs)."""
    kinds, *arrays = weight
    new_kinds = np.array([INT8_ACTIVATION_KINDS.get(int(kind), kind) for kind in kinds], np.int64)
    repacked = np.isin(new_kinds, (Q4_RUNS_OF_16_X8, Q8_X8))
    rows = arrays[0].shape[1]
    padded_rows = -(-rows // QDOT_GROUP_ROWS) * QDOT_GROUP_ROWS
    stacks = []
    for index, stack in enumerate(arrays[:5]):  # packed, high, scale, offset, dense
        width = stack.shape[2]
        if index in (2, 3) and repacked.all():
            width = -(-width // 2)
        padded = np.zeros((stack.shape[0], padded_rows, width), stack.dtype)
        if width == stack.shape[2]:
            padded[:, :rows] = stack
        stacks.append(padded)
    packed, _, scale, offset, _ = stacks
    for layer, kind in enumerate(new_kinds):
        if not repacked[layer]:
            continue
        value_width = columns // 2 if kind == Q4_RUNS_OF_16_X8 else columns
        targets = [(packed, arrays[0], value_width, 16 if kind == Q4_RUNS_OF_16_X8 else 32),
                   (scale, arrays[2], columns // 32, 1)]
        if kind == Q4_RUNS_OF_16_X8:
            targets.append((offset, arrays[3], columns // 32, 1))
        for target, source, width, per_block in targets:
            groups = target[layer].reshape(padded_rows // QDOT_GROUP_ROWS, -1)
            order = rows_by_16(source[layer, :rows, :width], per_block)
            if per_block == 1:
                with np.errstate(over="ignore"):  # an overflow is refused just below
                    halves = order.astype(np.float16)
                if not np.array_equal(halves.astype(np.float32), order, equal_nan=True):
                    raise PymlError("a Q4_0, Q4_1 or Q8_0 block's scale or offset is not a float16 "
                                    "value (out of its range): leave out --activations q8_0")
                groups, order = groups.view(np.float16), halves
                groups[:] = 0  # the float32 values this layer's rows held
            groups[:, :order.shape[1]] = order
    return (new_kinds, *stacks)


def float_rows(model, param) -> tuple:
    """A weight parameter as the step's float rows: the values the folder holds, read without BLAS."""
    matrices = [model.device.to_host(matrix) for matrix in layer_weights(param)]
    return weight_tuple([DENSE] * len(matrices), [{"dense": matrix} for matrix in matrices],
                        len(matrices[0]))


def float_row_weights(model, linears) -> tuple[dict[str, tuple], dict[str, str]]:
    """Every linear weight as float rows in the model's dtype, with each op's format."""
    weights = {prefix: float_rows(model, getattr(model.params, attr)) for prefix, attr, _, _ in linears}
    return weights, {prefix: np.dtype(model.params.flat.dtype).name.upper() for prefix in weights}


def kept_arrays(ggml_type: GGMLType, arrays: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
    """gguf_quantized's arrays of a matrix under the step's names."""
    if ggml_type == GGMLType.Q8_0:
        return {"packed": arrays[0], "scale": arrays[1]}
    if ggml_type == GGMLType.Q6_K:
        return dict(zip(("packed", "high", "scale"), arrays))
    if ggml_type == GGMLType.Q5_0:
        return dict(zip(("packed", "high", "scale", "offset"), arrays))
    return dict(zip(("packed", "scale", "offset"), arrays))


def layer_weights(param) -> list[np.ndarray]:
    """A weight parameter's matrix per layer: a per-layer parameter is a list of views."""
    return list(param) if isinstance(param, list) else [param]


def requantized_weights(model, linears, target: GGMLType) -> tuple[dict[str, tuple], dict[str, str]]:
    """Every linear weight quantized to `target`, and the float32 model's weights replaced by the
    dequantization of those blocks (so the prefill runs the same weights); with each op's format."""
    weights = {}
    for prefix, attr, _, _ in linears:
        layers = []
        for weight in layer_weights(getattr(model.params, attr)):
            rows, columns = weight.shape
            if columns % 32:
                raise PymlError(f"{attr}: rows of {columns} values are not whole {target.name} "
                                "blocks of 32; use --weights f32")
            raw = quantize(model.device.to_host(weight), target).reshape(-1)
            model.device.to_device(dequantize(raw, target, (rows, columns)), weight)
            layers.append(kept_arrays(target, quantized_matrix(raw, int(target), (rows, columns)).arrays))
        weights[prefix] = weight_tuple([STEP_KINDS[target]] * len(layers), layers, rows)
    return weights, {prefix: target.name for prefix in weights}


def stored_weights(model, linears, gguf_path: Path) -> tuple[dict[str, tuple], dict[str, str]]:
    """Every linear weight as the GGUF stores it where one kept type covers all its parts and
    layers, else as float32 rows (the folder's weights, the same values); with each op's format."""
    from pyml.formats.gguf_architectures import architecture_of
    from pyml.formats.gguf_read import read_gguf

    gguf = read_gguf(gguf_path)
    architecture = architecture_of(gguf)
    derived = architecture.derived_tensors()  # rope_freqs.weight: no weight of the model
    gguf_names = {architecture.hf_name(name): name for name in gguf.tensors if name not in derived}
    weights, formats = {}, {}
    for prefix, attr, _, tensors in linears:
        param = getattr(model.params, attr)
        per_layer = isinstance(param, list)
        sources = [[gguf_names.get(name.format(l=l) if per_layer else name) for name, _, _ in tensors]
                   for l in range(len(layer_weights(param)))]
        # one kept type per layer (all its parts), and one packed width for all layers
        types = [{gguf.tensors[name].ggml_type if name else None for name in names} for names in sources]
        if (any(len(kinds) != 1 or next(iter(kinds)) not in STEP_KINDS for kinds in types)
                or len({PACKED_PER_VALUE[next(iter(kinds))] for kinds in types}) != 1):
            weights[prefix], formats[prefix] = float_rows(model, param), "F32"
            continue
        layer_types = [next(iter(kinds)) for kinds in types]
        layers = []
        for names, ggml_type in zip(sources, layer_types):
            parts = []
            for name, (_, first, last) in zip(names, tensors):
                tensor = gguf.tensors[name]
                if tensor.shape != (last - first, layer_weights(param)[0].shape[1]):
                    raise PymlError(f"{gguf_path}: tensor {name!r} of shape {tensor.shape} is not "
                                    f"the folder's {attr} rows {first}:{last}; import the GGUF again")
                matrix = quantized_matrix(np.asarray(tensor.data), int(ggml_type), tensor.shape)
                # the row order the import gave the float32 weight (llama's rotary q and k rows)
                order = architecture.hf_weight(name, np.arange(tensor.shape[0])[:, None])[:, 0]
                parts.append(matrix.rows(order).arrays)
            layers.append(kept_arrays(ggml_type, tuple(np.concatenate(arrays) for arrays in zip(*parts))))
        weights[prefix] = weight_tuple([STEP_KINDS[t] for t in layer_types], layers, len(layers[0]["packed"]))
        formats[prefix] = "/".join(sorted({t.name for t in layer_types}))
    return weights, formats


@dataclass
class FusedCache:
    """A CUDA generation's state: the float32 package's one-position buffers (which hold the
    logits), the step's arguments, and how many positions the cache holds."""

    buffers: object
    arguments: tuple
    length: int
    max_len: int


class DecodingBatch:
    """The CPU step's sequences: the keys and values of up to `capacity` sequences of up to
    `max_len` positions each, one row of the caches per sequence (attention op i's keys and values:
    (layers, capacity, kv heads, slots, head dim), each kv head's slots contiguous, which the
    step's attention reads as one stream), and how many positions of each the caches hold.

    `add` gives a prompt a free row; `step` runs one decode step on the next token of any rows
    and, in the same step, up to `chunk` tokens of the prompts not yet in the caches (in the order
    they were added), each token an entry of the batch at its own position; `release` frees a
    row. So a long prompt is prefilled a chunk per step, between the other sequences' tokens, on
    the same weights and in the same step as they are. Every entry is computed as it would be
    alone (the linear maps give each its own sums in a fixed order, attention reads its own row),
    so a sequence's logits do not depend on the load: not on the rows beside it, their order, or
    how its prompt was split into chunks."""

    def __init__(self, decoder: QuantizedDecoder, capacity: int, max_len: int, chunk: int = PREFILL_CHUNK):
        model = decoder.model
        if max_len > model.MAX_SEQ_LEN:
            raise PymlError(f"{max_len} positions exceed the spec's max_seq_len {model.MAX_SEQ_LEN}")
        self.decoder, self.capacity, self.max_len, self.chunk = decoder, capacity, max_len, chunk
        self.keys, self.values = [], []
        for attention in model.ATTENTIONS:
            # a sliding layer's ring: its window, and room for the positions a step adds (decode_rows)
            slots = max(min(window + chunk - 1, max_len) if window else max_len for window in attention["windows"])
            shape = (len(attention["windows"]), capacity, attention["n_kv_heads"], slots, attention["head_dim"])
            self.keys.append(np.zeros(shape, model.device.dtype))
            self.values.append(np.zeros(shape, model.device.dtype))
        self.lengths = np.zeros(capacity, np.int64)
        self.prompts: dict[int, list[int]] = {}  # by row: the prompt's tokens not yet in the caches
        self.free = list(range(capacity - 1, -1, -1))
        self.steps: dict[int, tuple] = {}  # entries -> (one-position buffers, step arguments)

    def add(self, prompt_ids) -> int:
        """Give `prompt_ids` (a list of ids) a free row, to be prefilled by the next steps: the row."""
        if not self.free:
            raise PymlError(f"all {self.capacity} sequences of the batch are in use")
        if not 0 < len(prompt_ids) <= self.max_len:
            raise PymlError(f"the prompt has {len(prompt_ids)} tokens: a sequence takes 1 to "
                            f"{self.max_len}")
        row = self.free.pop()
        self.prompts[row] = list(prompt_ids)
        return row

    def step(self, next_ids: dict[int, int]) -> dict[int, np.ndarray]:
        """Append token next_ids[row] to the sequence in each given row, and the next chunk of the
        prompts waiting: the logits (VOCAB,) of each row that has a next token to draw, the given
        rows and those whose prompt's last token was in this step."""
        # (row, token, position): first those whose logits are drawn from (the step computes the
        # logits of its first entries only; the entries' order changes nothing else), then the
        # rest of the prompts' chunks
        drawn = [(row, token, int(self.lengths[row])) for row, token in next_ids.items()]
        if any(position >= self.max_len for _, _, position in drawn):
            raise PymlError(f"the decoding cache is full ({self.max_len} positions)")
        prefilled, budget = [], self.chunk
        for row in list(self.prompts):
            if budget == 0:
                break
            prompt, start = self.prompts[row], int(self.lengths[row])
            taken = [(row, token, start + offset) for offset, token in enumerate(prompt[start : start + budget])]
            budget -= len(taken)
            if taken[-1][2] + 1 == len(prompt):  # the prompt's last position: its logits are drawn from
                del self.prompts[row]
                drawn.append(taken.pop())
            prefilled += taken
        entries = drawn + prefilled
        if not entries:
            return {}
        rows, ids, positions = (np.array(column, np.int64) for column in zip(*entries))
        buffers, arguments = self.step_for(len(entries))
        self.decoder.model.load_batch(ids[:, None], buffers.ids, "next_ids")
        self.decoder.step.decode_step(positions, rows, len(drawn), *arguments)
        np.maximum.at(self.lengths, rows, positions + 1)
        return {row: buffers.logits[entry].copy() for entry, (row, _, _) in enumerate(drawn)}

    def step_for(self, entries: int) -> tuple:
        """The one-position buffers of `entries` rows and the step's arguments on them (the last
        BUFFER_SHAPES sizes are kept: a step's size changes with the prompts it prefills)."""
        if entries not in self.steps:
            if len(self.steps) == BUFFER_SHAPES:
                del self.steps[next(iter(self.steps))]
            model, decoder = self.decoder.model, self.decoder
            buffers = model.DecodeBuffers(model.device, entries, 1)  # its own cache is not used
            self.steps[entries] = buffers, decoder.step.step_arguments(model, buffers, decoder.weights,
                                                                       self.keys, self.values)
        self.steps[entries] = self.steps.pop(entries)  # the most recently used last
        return self.steps[entries]

    def release(self, row: int) -> None:
        self.lengths[row] = 0
        self.prompts.pop(row, None)
        self.free.append(row)


class QuantizedDecoder:
    """The decode step of a float32 model's device on `weights` (on CUDA the float32 model
    prefills the prompt); what `pyml.generate.decoding.generate` calls (start_decoding, decode)
    as on a package's Model."""

    def __init__(self, model, step: ModuleType, weights: dict[str, tuple], formats: dict[str, str]):
        if model.device.name == "cuda":
            from pyml.package.decode_cuda import device_weight

            weights = {prefix: device_weight(weight) for prefix, weight in weights.items()}
        self.model, self.step, self.weights, self.formats = model, step, weights, formats

    @classmethod
    def load(cls, model, weights: str, gguf_path: Path | None, activations: str = "f32") -> QuantizedDecoder:
        """`model` decoding on `weights` (a --weights value other than f32) times `activations`
        (an --activations value); as-stored reads the GGUF at `gguf_path`."""
        step = decode_module(model)
        if weights == "as-stored":
            kept, formats = stored_weights(model, step.LINEARS, gguf_path)
        else:
            kept, formats = requantized_weights(model, step.LINEARS, QUANTIZE_TO[weights])
        if activations == "q8_0":
            columns = {prefix: layer_weights(getattr(model.params, attr))[0].shape[1]
                       for prefix, attr, _, _ in step.LINEARS}
            for prefix, weight in kept.items():
                kept[prefix] = with_int8_activations(weight, columns[prefix])
                rounded = {int(kind) for kind in kept[prefix][0]} & set(INT8_ACTIVATION_KINDS.values())
                if rounded:
                    formats[prefix] += (" x Q8_0 activations" if len(rounded) == len(set(kept[prefix][0]))
                                        else " (Q8_0 activations on its Q4_0, Q4_1 and Q8_0 layers)")
        return cls(model, step, kept, formats)

    @classmethod
    def on_float_rows(cls, model) -> QuantizedDecoder:
        """`model` decoding through its fused step with its own weights as float rows (what a
        batch of sequences needs where the folder stores float32)."""
        step = decode_module(model)
        return cls(model, step, *float_row_weights(model, step.LINEARS))

    def describe_formats(self) -> str:
        """The formats the linear maps run in, e.g. "Q4_1 (4 ops), Q8_0 (lm_head)"."""
        ops: dict[str, list[str]] = {}
        for prefix, name in self.formats.items():
            ops.setdefault(name, []).append(prefix)
        return ", ".join(f"{name} ({prefixes[0] if len(prefixes) == 1 else f'{len(prefixes)} ops'})"
                         for name, prefixes in ops.items())

    def start_decoding(self, prompt_ids, max_len):
        """One sequence's prefill, as the float32 model's start_decoding: (its state, the logits
        (1, VOCAB) of the prompt's last position)."""
        if np.shape(prompt_ids)[0] != 1:
            raise PymlError("the fused decode step starts one sequence at a time")
        if self.model.device.name == "cpu":
            batch = DecodingBatch(self, 1, max_len)
            row, logits = batch.add(list(np.asarray(prompt_ids)[0])), {}
            while not logits:
                logits = batch.step({})
            return batch, logits[row][None]
        # the CUDA step takes the float32 cache's own arrays
        cache, logits = self.model.start_decoding(prompt_ids, max_len)
        arguments = self.step.step_arguments(self.model, cache, self.weights, cache.keys, cache.values)
        return FusedCache(cache, arguments, cache.length, cache.max_len), logits

    def decode(self, cache, next_ids):
        """The next token's logits (1, VOCAB) of a sequence `start_decoding` began."""
        if isinstance(cache, DecodingBatch):
            return cache.step({0: int(np.reshape(next_ids, -1)[0])})[0][None]
        if cache.length >= cache.max_len:
            raise PymlError(f"the decoding cache is full ({cache.max_len} positions)")
        self.model.load_batch(np.reshape(next_ids, (-1, 1)), cache.buffers.ids, "next_ids")
        self.step.decode_step(cache.length, *cache.arguments)
        cache.length += 1
        return self.model.device.to_host(cache.buffers.logits).copy()
