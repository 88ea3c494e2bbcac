"""Decoding through a package's fused decode step: gen/<name>/decode_cpu.py (one Numba call per
step for a batch of sequences) on the CPU, gen/<name>/decode_cuda.py on device="cuda".

`pyml generate --weights` picks the weights the linear maps run on:

    as-stored  as the folder stores them: its GGUF's tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K,
               F32, F16, BF16, and on the CPU Q5_K, any mix, read in place by memory map; other types
               as float32 rows of that tensor), or its safetensors' rows (float32, float16 or bfloat16).
    q8_0, q4_0, q4_1  every linear weight quantized by llama.cpp's reference quantizer
               (pyml.formats.quantize), a tensor at a time.
    f32        the float32 package's own decoding step, on a float32 copy of the weights.

`pyml generate --activations` picks what the quantized weights multiply:

    f32        the float32 activations (the default): the products are the dequantized weights
               times x up to float32 summation order.
    q8_0       x rounded to int8 per 32 values first, as llama.cpp's CPU products do, and each
               block's product summed in integers (pyml/package/quantized_dot.py). Faster, and
               less exact: a product's relative error grows to about 5e-3, and greedy tokens may
               part from the float32 path's. Q4_0, Q4_1 and Q8_0 layers run it (repacked: a copy
               of those layers); the others keep float32 activations. CPU only.

On the CPU the step reads the weights where they are stored, and the prompt runs through the same
step, PREFILL_CHUNK tokens of it per step (`DecodingBatch`), so a prompt's keys and values are the
step's own, whatever its length and whatever runs beside it; no float32 model exists
(pyml/generate/stored_step.py). On CUDA the float32 package's matrix-matrix forward prefills the
prompt and its keys and values seed the step's cache, on the same weights
(pyml/generate/cuda_weights.py).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from pyml.errors import PymlError
from pyml.weight_formats import GGMLType
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate.stored_step import (
    StepModel,
    model_tensors,
    step_parameters,
    step_weights,
    with_int8_activations,
)
from pyml.package.base import BUFFER_SHAPES
from pyml.package.decode_cpu import INT8_LAYER_KIND_OF, with_low_rank

WEIGHT_FORMATS = ("as-stored", "f32", "q8_0", "q4_0", "q4_1")
ACTIVATION_FORMATS = ("f32", "q8_0")
QUANTIZE_TO = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1}
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


def decode_module(package: str, device: str) -> ModuleType:
    """The decode step of the generated package named `package` for `device`: decode_cpu or
    decode_cuda."""
    name = f"{package}.decode_{device}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise PymlError(f"{package} has no fused decode step (a LoRA spec decodes in float32, and a "
                        f"package generated before it existed needs `pyml gen`): use --weights f32") from None


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
    how its prompt was split into chunks.

    The prefix cache follows from that: a free row keeps the keys and values of the tokens it
    last held, and `add` gives a prompt the free row whose tokens begin it the furthest, whose
    positions it then does not prefill again. They are the bits a prefill would write (the same
    tokens at the same positions, each entry computed as alone), so the answer is the uncached
    one. It costs no memory beyond the batch's rows; among the rows without a usable prefix the
    least recently freed is taken (`prefix_cache=False`: the least recently freed, always)."""

    def __init__(self, decoder: QuantizedDecoder, capacity: int, max_len: int, chunk: int = PREFILL_CHUNK,
                 prefix_cache: bool = True):
        model = decoder.model
        if max_len > model.MAX_SEQ_LEN:
            raise PymlError(f"{max_len} positions exceed the spec's max_seq_len {model.MAX_SEQ_LEN}")
        self.decoder, self.capacity, self.max_len, self.chunk = decoder, capacity, max_len, chunk
        self.prefix_cache = prefix_cache
        self.keys, self.values = [], []
        # how far a row's cached positions may run past a prefix it lends: a sliding layer's ring
        # keeps window + chunk - 1 positions, so the positions after the prefix overwrite the
        # oldest of those its next tokens read once they run further than the ring's spare room
        self.ring_room = max_len
        for attention in model.ATTENTIONS:
            # a sliding layer's ring: its window, and room for the positions a step adds (decode_rows)
            slots = max(min(window + chunk - 1, max_len) if window else max_len for window in attention["windows"])
            if slots < max_len:
                self.ring_room = min(self.ring_room, slots - max(attention["windows"]))
            shape = (len(attention["windows"]), capacity, attention["n_kv_heads"], slots, attention["head_dim"])
            self.keys.append(np.zeros(shape, model.device.dtype))
            self.values.append(np.zeros(shape, model.device.dtype))
        self.lengths = np.zeros(capacity, np.int64)
        self.prompts: dict[int, list[int]] = {}  # by row: the prompt's tokens not yet in the caches
        self.scored: set[int] = set()  # rows whose every prompt position's logits are wanted
        self.held: list[list[int]] = [[] for _ in range(capacity)]  # by row: the tokens its caches hold
        self.free = list(range(capacity))  # the least recently freed first
        self.steps: dict[int, tuple] = {}  # entries -> (one-position buffers, step arguments)

    def add(self, prompt_ids, score_prompt: bool = False) -> int:
        """Give `prompt_ids` (a list of ids) a free row, to be prefilled by the next steps: the row.
        Its `lengths` entry says how many of the prompt's first positions the row's cache already
        holds (the prefix cache). With `score_prompt` every position's logits are computed, and
        `step` hands them out: nothing is taken from the cache then."""
        if not self.free:
            raise PymlError(f"all {self.capacity} sequences of the batch are in use")
        if not 0 < len(prompt_ids) <= self.max_len:
            raise PymlError(f"the prompt has {len(prompt_ids)} tokens: a sequence takes 1 to "
                            f"{self.max_len}")
        prompt = list(prompt_ids)
        reused, row = 0, self.free[0]
        if self.prefix_cache and not score_prompt:
            for candidate in self.free:
                # the prompt's last position is always computed: its logits are drawn from
                usable = self.cached_prefix(candidate, prompt)
                if usable > reused:
                    reused, row = usable, candidate
        self.free.remove(row)
        self.held[row] = self.held[row][:reused]
        self.lengths[row] = reused
        self.prompts[row] = prompt
        if score_prompt:
            self.scored.add(row)
        return row

    def cached_prefix(self, row: int, prompt: list[int]) -> int:
        """How many of `prompt`'s first positions the free `row`'s cache holds as a prefill of
        them would write them, short of the prompt's last."""
        held = self.held[row]
        common = 0
        for held_token, token in zip(held, prompt[:-1]):
            if held_token != token:
                break
            common += 1
        return common if len(held) - common <= self.ring_room else 0

    def step(self, next_ids: dict[int, int], prompt_logits: dict | None = None) -> dict[int, np.ndarray]:
        """Append token next_ids[row] to the sequence in each given row, and the next chunk of the
        prompts waiting: the logits (VOCAB,) of each row that has a next token to draw, the given
        rows and those whose prompt's last token was in this step. For the rows added with
        `score_prompt`, `prompt_logits[row]` receives (positions, logits (k, VOCAB)) of the prompt
        positions this step prefilled, the last one's excepted (it is drawn from)."""
        # (row, token, position): first those whose logits are computed (the step computes the
        # logits of its first entries only; the entries' order changes nothing else): the drawn,
        # then the scored prompts' chunks; then the rest of the prompts' chunks
        if self.scored and prompt_logits is None:
            raise PymlError("a scored prompt's logits need a prompt_logits dict to go to")
        drawn = [(row, token, int(self.lengths[row])) for row, token in next_ids.items()]
        if any(position >= self.max_len for _, _, position in drawn):
            raise PymlError(f"the decoding cache is full ({self.max_len} positions)")
        scored, prefilled, budget = [], [], self.chunk
        for row in list(self.prompts):
            if budget == 0:
                break
            prompt, start = self.prompts[row], int(self.lengths[row])
            taken = [(row, token, start + offset) for offset, token in enumerate(prompt[start : start + budget])]
            budget -= len(taken)
            if taken[-1][2] + 1 == len(prompt):  # the prompt's last position: its logits are drawn from
                del self.prompts[row]
                drawn.append(taken.pop())
            (scored if row in self.scored else prefilled).extend(taken)
            if row not in self.prompts:
                self.scored.discard(row)
        entries = drawn + scored + prefilled
        if not entries:
            return {}
        rows, ids, positions = (np.array(column, np.int64) for column in zip(*entries))
        buffers, arguments = self.step_for(len(entries))
        self.decoder.model.load_batch(ids[:, None], buffers.ids, "next_ids")
        self.decoder.step.decode_step(positions, rows, len(drawn) + len(scored), *arguments)
        np.maximum.at(self.lengths, rows, positions + 1)
        for row, token, position in sorted(entries, key=lambda entry: entry[2]):
            self.held[row][position:] = [token]
        for entry, (row, _, position) in enumerate(scored, start=len(drawn)):
            positions_of_row, logits_of_row = prompt_logits.setdefault(row, ([], []))
            positions_of_row.append(position)
            logits_of_row.append(buffers.logits[entry].copy())
        return {row: buffers.logits[entry].copy() for entry, (row, _, _) in enumerate(drawn)}

    def score(self, tokens: list[int]) -> np.ndarray:
        """The logits (len(tokens), VOCAB) of every position of `tokens`, a sequence of its own in a
        free row (free again after), prefilled as `step` prefills a scored prompt: what scoring a
        text needs (`pyml eval`). Each position's logits are the bits `step` gives it."""
        row = self.add(tokens, score_prompt=True)
        try:
            scored: dict = {}
            last = {}
            while row not in last:
                last = self.step({}, scored)
            logits = np.empty((len(tokens), self.decoder.model.VOCAB), self.decoder.model.device.dtype)
            if row in scored:
                logits[scored[row][0]] = scored[row][1]
            logits[-1] = last[row]
            return logits
        finally:
            self.release(row)

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
        """Free `row`; its caches keep the tokens they hold, a prefix for the prompts to come."""
        self.lengths[row] = 0
        self.prompts.pop(row, None)
        self.scored.discard(row)
        self.free.append(row)


class QuantizedDecoder:
    """The fused decode step on kept weights; what `pyml.generate.decoding.generate` calls
    (start_decoding, decode) as on a package's Model. On the CPU `model` is a `StepModel` and the
    weights are read where they are stored (pyml/generate/stored_step.py): no float32 model
    exists. On CUDA `model` is the float32 model (which prefills the prompt), and the weights are
    its tuples copied to the device."""

    def __init__(self, model, step: ModuleType, weights: dict[str, tuple], formats: dict[str, str],
                 kept: tuple = ()):
        if model.device.name == "cuda":
            from pyml.package.decode_cuda import device_weight

            weights = {prefix: device_weight(weight) for prefix, weight in weights.items()}
        self.model, self.step, self.weights, self.formats = model, step, weights, formats
        self.kept = kept  # what the CPU weight tuples' addresses point into: kept alive with them

    @classmethod
    def on_tensors(cls, package: ModuleType, tensors: dict, weights: str = "as-stored",
                   activations: str = "f32", dtype=np.float32, adapter: Path | None = None) -> QuantizedDecoder:
        """The CPU step of `package` (a generated decoder package) on `tensors` (StoredTensors by
        Hugging Face name): as stored, or quantized to `weights` (q8_0, q4_0, q4_1) first, times
        `activations` (an --activations value); its activations in `dtype`. A LoRA `adapter`
        folder's updates are added beside the rows, not folded into them (`low_rank_updates`)."""
        step = decode_module(package.__name__, "cpu")
        n_layers = package.model.N_LAYERS
        model = StepModel(package, step_parameters(step, tensors, n_layers, dtype), dtype)
        stored = step_weights(step, tensors, n_layers, QUANTIZE_TO.get(weights))
        if adapter is not None:
            from pyml.train.lora import low_rank_updates

            for prefix, (down, up) in low_rank_updates(adapter, step.LINEARS, n_layers, tensors).items():
                stored.weights[prefix] = with_low_rank(stored.weights[prefix], down, up)
                stored.formats[prefix] += " + LoRA"
        if activations == "q8_0":
            rounded = set(INT8_LAYER_KIND_OF.values())
            for prefix, _, _, _ in step.LINEARS:
                weight = stored.weights[prefix] = with_int8_activations(stored.weights[prefix])
                kinds = set(np.unique(weight[2]).tolist())
                if kinds & rounded:
                    stored.formats[prefix] += (" x Q8_0 activations" if kinds <= rounded
                                               else " (Q8_0 activations on its Q4_0, Q4_1 and Q8_0 layers)")
            if not any("Q8_0 activations" in text for text in stored.formats.values()):
                raise PymlError("--activations q8_0 multiplies Q4_0, Q4_1 and Q8_0 weights, and these "
                                f"are {'/'.join(sorted(set(stored.formats.values())))}: add --weights "
                                "q8_0, q4_0 or q4_1")
        return cls(model, step, stored.weights, stored.formats, tuple(stored.kept))

    @classmethod
    def of_folder(cls, package: ModuleType, folder: Path, weights: str = "as-stored",
                  activations: str = "f32", adapter: Path | None = None) -> QuantizedDecoder:
        """The CPU step of `package` on the weights of the model folder `folder`, read by memory
        map in the form the folder stores them (with a LoRA `adapter` folder's updates beside them)."""
        return cls.on_tensors(package, StoredFolder(folder).tensors, weights, activations, adapter=adapter)

    @classmethod
    def of_model(cls, model, weights: str = "as-stored", activations: str = "f32",
                 gguf_path: Path | None = None) -> QuantizedDecoder:
        """The step of `model`'s package on `model`'s own weights (as-stored: its float rows, read
        in place; on CUDA, the tensors of the GGUF at `gguf_path` where one is given), or
        quantized to `weights`. On CUDA the float32 model prefills the prompt, and quantized
        weights replace its own by their dequantization, so both run the same."""
        package = sys.modules[type(model).__module__.rsplit(".", 1)[0]]
        if model.device.name == "cpu":
            return cls.on_tensors(package, model_tensors(model), weights, activations, model.device.dtype)
        if activations != "f32":
            raise PymlError(f"--activations {activations} runs on the CPU only: leave it out to "
                            "decode on the GPU")
        from pyml.generate.cuda_weights import float_row_weights, requantized_weights, stored_weights

        step = decode_module(package.__name__, "cuda")
        if weights != "as-stored":
            return cls(model, step, *requantized_weights(model, step.LINEARS, QUANTIZE_TO[weights]))
        if gguf_path is not None:
            return cls(model, step, *stored_weights(model, step.LINEARS, gguf_path))
        return cls(model, step, *float_row_weights(model, step.LINEARS))

    def forward(self, input_ids, positions=None) -> np.ndarray:
        """Logits (B, T, VOCAB) of every position, as the float32 model's forward gives them (`pyml
        eval`), through the CPU step: each example of a row (a packed row's positions restart at 0
        where one starts: `DecoderModel.load_positions`) scored as a sequence of its own."""
        if self.model.device.name != "cpu":
            raise PymlError("scoring through the fused step runs on the CPU")
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise PymlError(f"input_ids must be a 2-D array (B, T), got {ids.shape}")
        batch = DecodingBatch(self, 1, ids.shape[1])
        logits = np.empty((*ids.shape, self.model.VOCAB), self.model.device.dtype)
        for b, row in enumerate(ids):
            starts = [0] if positions is None else np.flatnonzero(np.asarray(positions)[b] == 0).tolist()
            for start, stop in zip(starts, starts[1:] + [len(row)]):
                logits[b, start:stop] = batch.score(row[start:stop].tolist())
        return logits

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
