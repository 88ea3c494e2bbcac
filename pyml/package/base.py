"""What every generated package is built on: device buffers, the flat parameter buffer, the
model classes' spec-independent methods, AdamW and `train_step`.

A generated `model.py` holds only what its spec specialises: the dims, the parameter layout and
tensor names, the buffers its ops need, and the straight-line forward, backward and decoding
passes (`run_forward`, `run_loss_and_backward`, `run_decode`). It subclasses `DecoderModel` or
`SequentialModel` here and sets the class attributes they read. This module is hashed into every
generated package's manifest, so a change here shows up in `pyml check`.
"""

# pyml first: its import sets the thread-pool policy that numpy's OpenBLAS reads when it loads
import pyml  # noqa: F401, I001

import math
import os
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.package.accumulate import loss_and_grads
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.package.cpu.rope import rope_tables
from pyml.formats.safetensors_io import write_safetensors
from pyml.formats.stored_tensors import StoredFolder, stored_weights
from pyml.package.stored_rows import StoredMaps

BUFFER_SHAPES = 4  # the (B, T) shapes whose activation buffers a model keeps


def available_memory() -> int:
    """Bytes of memory this process may still use: MemAvailable where the kernel reports it."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def require_memory(n_bytes: int, what: str) -> None:
    """Refuse, before allocating, what the machine cannot hold."""
    available = available_memory()
    if n_bytes > available:
        raise PymlError(
            f"{what} needs {n_bytes / 2**30:.1f} GiB but {available / 2**30:.1f} GiB "
            "of memory is available"
        )


def heads(array, start, stop):
    """Heads start:stop of a (..., heads, head_dim) array, as a view: basic slices only, since
    numba's device arrays take no Ellipsis; writes go through."""
    return array[(slice(None),) * (array.ndim - 2) + (slice(start, stop),)]


def layer_views(flat, start, stride, shape, n_layers):
    """Views of one per-layer parameter in a flat buffer where each layer's parameters are
    contiguous: layer l's starts at `start + l * stride`."""
    size = math.prod(shape)
    return [
        flat[start + l * stride : start + l * stride + size].reshape(shape) for l in range(n_layers)
    ]


def map_views(maps, attr, start, stride, shape, n_layers):
    """A per-layer frozen linear map's matrices: views into the float buffer `maps` (as
    layer_views), or its `StoredRows` where `maps` is a StoredMaps (the base's rows in place)."""
    if isinstance(maps, StoredMaps):
        return maps.layer_rows(attr, shape)
    return layer_views(maps, start, stride, shape, n_layers)


def map_view(maps, attr, start, shape):
    """A model-level frozen linear map's matrix (an untied LM head), as map_views."""
    if isinstance(maps, StoredMaps):
        return maps.layer_rows(attr, shape)[0]
    return maps[start : start + math.prod(shape)].reshape(shape)


class Device:
    """Allocation and transfer for one device; the kernels module does all arithmetic."""

    def __init__(self, name, dtype, kernels_cpu, kernels_cuda):
        if name not in ("cpu", "cuda"):
            raise PymlError(f"unknown device '{name}' (expected cpu or cuda)")
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise PymlError(f"unsupported dtype {np.dtype(dtype)} (expected float32 or float64)")
        self.name, self.dtype = name, np.dtype(dtype)
        if name == "cuda":
            from numba import cuda

            if not cuda.is_available():
                raise PymlError("device 'cuda' requested but no CUDA GPU is available")
            from pyml.package.cuda_products import chosen_route

            chosen_route()  # a bad PYML_CUDA_PRODUCTS fails here, in one line, not mid-step
            self.cuda, self.kernels = cuda, kernels_cuda()
        else:
            self.kernels = kernels_cpu()

    def zeros(self, shape, dtype=None):
        host = np.zeros(shape, dtype or self.dtype)
        return host if self.name == "cpu" else self.cuda.to_device(host)

    def to_device(self, host, out):
        """Copy host data into the preallocated `out` (no allocation on the device)."""
        if self.name == "cpu":
            out[...] = host
        else:
            out.copy_to_device(np.ascontiguousarray(host, dtype=out.dtype))

    def to_host(self, array):
        return array if self.name == "cpu" else array.copy_to_host()

    def zero(self, array):
        if self.name == "cpu":
            array.fill(0)
        else:
            array.copy_to_device(np.zeros(array.shape, array.dtype))


PRECISIONS = ("f32", "bf16")


class Bf16Kernels:
    """A generated kernels module whose linear layers multiply in bf16: each product's operands
    rounded to bfloat16, the sums in float32 (pyml/package/bf16_products.py), as torch's CPU
    autocast runs `linear`; every other kernel (norms, attention, softmax, the loss, AdamW) is the
    module's own, in float32."""

    def __init__(self, kernels):
        from pyml.package.cpu import linear

        self.kernels = kernels
        self.linear_forward, self.linear_bias_forward = linear.linear_forward_bf16, linear.linear_bias_forward_bf16
        self.linear_backward, self.linear_bias_backward = (linear.linear_backward_bf16,
                                                          linear.linear_bias_backward_bf16)

    def __getattr__(self, name):
        return getattr(self.kernels, name)


def check_precision(precision, dtype, device):
    """Refuse, in one line, a precision this model, device or CPU cannot run."""
    from pyml.package.bf16_products import has_bf16_products

    if precision not in PRECISIONS:
        raise PymlError(f"--precision must be f32 or bf16, got '{precision}'")
    if precision == "f32":
        return
    if device != "cpu":
        raise PymlError("--precision bf16 runs on the CPU only (its products are AVX-512 BF16 kernels)")
    if np.dtype(dtype) != np.float32:
        raise PymlError(f"--precision bf16 keeps float32 master weights: use --dtype float32, not {np.dtype(dtype)}")
    if not has_bf16_products():
        raise PymlError("--precision bf16 needs a CPU with AVX-512 BF16 (vdpbf16ps), which this one lacks: "
                        "train in f32")


def no_bucket_hook(bucket):
    """The default `on_grads_ready`: nobody waits for gradients during the backward pass."""


class Model:
    """The spec-independent part of a generated model. Subclasses set `Parameters` (the views of
    the flat buffer of trainable parameters and, for a LoRA model, of the frozen base weights),
    `TENSOR_TABLE` (each trainable tensor's name in tensor files: its view, initialisation and
    fan-in) and `FROZEN_TENSOR_TABLE` (the same for the frozen ones), `GRAD_BUCKETS`, `SPEC_NAME`
    and the kernel modules, and define the passes and their buffers."""

    FROZEN_TENSOR_TABLE = None
    MAP_TENSOR_TABLE = None

    @classmethod
    def table_bytes(cls, itemsize):
        """Bytes of the tables a model allocates beside its parameters (a decoder's RoPE tables)."""
        return 0

    @classmethod
    def tables_described(cls):
        return ""

    def __init__(self, dtype=np.float32, device="cpu", maps=None):
        """Zeroed parameters on `device`; a LoRA model's frozen linear maps in a float buffer, or
        read where its base folder stores them where `maps` (a StoredMaps, CPU only) is given."""
        itemsize = np.dtype(dtype).itemsize if np.dtype(dtype) in (np.float32, np.float64) else 4
        size = self.Parameters.SIZE
        frozen = self.Parameters.FROZEN_SIZE + (self.Parameters.MAPS_SIZE if maps is None else 0)
        what = f"{size:,} parameters and their gradients" + (
            f", and {frozen:,} frozen ones" if frozen else "") + self.tables_described()
        require_memory((2 * size + frozen) * itemsize + self.table_bytes(itemsize),
                       f"spec '{self.SPEC_NAME}' ({what})")
        self.device = Device(device, dtype, self.kernels_cpu, self.kernels_cuda)
        if maps is not None and (device != "cpu" or maps.dtype != self.device.dtype):
            raise PymlError("a base read where it is stored runs on the CPU, in the model's dtype")
        if maps is None and self.Parameters.MAPS_SIZE:
            maps = self.device.zeros(self.Parameters.MAPS_SIZE)
        self.params = self.Parameters(
            self.device.zeros(size),
            self.device.zeros(self.Parameters.FROZEN_SIZE) if self.Parameters.FROZEN_SIZE else None,
            maps)
        self.grads = self.Parameters(self.device.zeros(size))
        self.buffers = {}
        self.precision = "f32"

    def set_precision(self, precision):
        """Run the linear layers' products in `precision`: "f32", or "bf16" (float32 models on a
        CPU with AVX-512 BF16; the weights, gradients and every other op stay float32)."""
        from pyml.package.cpu.frozen_linear import Bf16Weight

        check_precision(precision, self.device.dtype, self.device.name)
        kernels = self.kernels_cpu() if self.device.name == "cpu" else self.kernels_cuda()
        self.device.kernels = Bf16Kernels(kernels) if precision == "bf16" else kernels
        # a LoRA model's frozen maps take the precision with them, to the rendered kernels'
        # frozen_product and frozen_input_gradient
        def weight(view):
            rows = view.rows if isinstance(view, Bf16Weight) else view
            return Bf16Weight(rows) if precision == "bf16" else rows

        for attr in self.Parameters.MAPS:
            views = getattr(self.params, attr)
            setattr(self.params, attr, [weight(view) for view in views] if isinstance(views, list) else weight(views))
        self.precision = precision

    @property
    def stored_maps(self):
        """The StoredMaps the frozen linear maps are read from, or None (a float buffer)."""
        return self.params.maps if isinstance(self.params.maps, StoredMaps) else None

    @classmethod
    def host_parameters(cls, dtype=np.float64, maps=True):
        """Zeroed host buffers with every parameter's view, frozen ones included (the frozen
        linear maps' only with `maps`)."""
        frozen, map_size = cls.Parameters.FROZEN_SIZE, cls.Parameters.MAPS_SIZE
        return cls.Parameters(np.zeros(cls.Parameters.SIZE, dtype),
                              np.zeros(frozen, dtype) if frozen else None,
                              np.zeros(map_size, dtype) if map_size and maps else None)

    @property
    def grad_buckets(self):
        """(start, stop) ranges of `grads.flat` in the order the backward pass makes them final."""
        return list(self.GRAD_BUCKETS)

    @classmethod
    def initialized(cls, seed=0, dtype=np.float32, device="cpu"):
        """Each tensor initialised as its `TENSOR_TABLE` entry says: N(0, 0.02) for decoder matrices (as
        Hugging Face's Llama and Gemma), torch.nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for
        sequential ones, gains 1 (or 0 where the gain is 1 + w) and biases 0."""
        model = cls(dtype, device)
        table = cls.tensor_entries(cls.host_parameters())
        model.load_tensors(initial_tensors(table, seed), "initialisation")
        return model

    @classmethod
    def from_safetensors(cls, path, dtype=np.float32, device="cpu"):
        """Load `path`: a safetensors file, or a model folder (its weights as it stores them:
        source.gguf, model.safetensors or shards)."""
        model = cls(dtype, device)
        model.load_tensors(*stored_weights(path, dtype))
        return model

    def load_tensors(self, tensors, source):
        """Every parameter, trainable and frozen, from `tensors` ({name: array}); the frozen linear
        maps' only where they are a float buffer (stored ones are read in place)."""
        host = self.host_parameters(self.device.dtype, maps=self.stored_maps is None)
        expected = self.tensors(host)
        check_tensors(tensors, expected, source, self.SPEC_NAME)
        for name, view in expected.items():
            view[...] = tensors[name]
        self.device.to_device(host.flat, self.params.flat)
        for part in ("frozen", "maps"):
            if getattr(host, part) is not None:
                self.device.to_device(getattr(host, part), getattr(self.params, part))

    def host_tensors(self):
        """Named host copies of the parameters, frozen ones included (but stored maps)."""
        def host(part):
            return None if part is None else self.device.to_host(part).copy()

        return self.tensors(self.Parameters(
            host(self.params.flat), host(self.params.frozen),
            None if self.stored_maps is not None else host(self.params.maps)))

    @classmethod
    def tensor_entries(cls, params):
        """The tensor table (name: (view, initialisation, fan-in)) of what `params` holds: the
        trainable parameters, and the frozen ones and float maps where it holds them."""
        table = dict(cls.TENSOR_TABLE(params))
        if params.frozen is not None and cls.FROZEN_TENSOR_TABLE is not None:
            table |= cls.FROZEN_TENSOR_TABLE(params)
        if params.maps is not None and not isinstance(params.maps, StoredMaps):
            table |= cls.MAP_TENSOR_TABLE(params)
        return table

    @classmethod
    def tensors(cls, params):
        """The parameters in `params` under their names in tensor files (views); the frozen ones
        too where `params` holds them."""
        return {name: entry[0] for name, entry in cls.tensor_entries(params).items()}

    @classmethod
    def from_base(cls, path, seed=0, dtype=np.float32, device="cpu"):
        """A LoRA model: the frozen base weights from `path` (a safetensors file, or a model
        folder, with the base model's tensor names) and the adapters initialised as the
        `peft` library does (A uniform in +-1/sqrt(fan_in), B zero), seeded. On the CPU, a
        folder's frozen linear maps are read where it stores them (quantized rows, bf16, ...:
        `StoredMaps`), so the model costs about the file's size; the other frozen weights (norms,
        the embedding) are float arrays of `dtype`."""
        if cls.FROZEN_TENSOR_TABLE is None:
            raise PymlError(f"spec '{cls.SPEC_NAME}' has no [lora] table: load it with from_safetensors")
        # the adapters come first in `initialized`'s table, so they draw the same values here
        # without drawing (and holding) a random base that the file would replace
        adapters = initial_tensors(cls.TENSOR_TABLE(cls.Parameters(np.zeros(cls.Parameters.SIZE))), seed)
        path = Path(path)
        if device != "cpu" or not path.is_dir() or not cls.Parameters.MAPS_SIZE:
            model = cls(dtype, device)
            base, source = stored_weights(path, dtype)
            model.load_tensors(adapters | base, source)
            return model
        stored = StoredFolder(path)
        maps = StoredMaps(stored.tensors, cls.Parameters.MAPS, cls.N_LAYERS, dtype)
        model = cls(dtype, device, maps)
        dense = cls.tensors(cls.host_parameters(maps=False))
        map_names = {pattern.format(l=l) for parts in cls.Parameters.MAPS.values()
                     for pattern, _, _ in parts for l in range(cls.N_LAYERS)}
        unexpected = sorted(set(stored.tensors) - set(dense) - set(adapters) - map_names)
        base = {name: stored.tensors[name].dense(dtype) for name in dense if name in stored.tensors
                and name not in adapters}
        source = str(stored.path / stored.source)
        if unexpected:
            raise PymlError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:3])} for spec "
                            f"'{cls.SPEC_NAME}'")
        model.load_tensors(adapters | base, source)
        return model

    def adapter_tensors(self):
        """Host copies of the trainable tensors (a LoRA model's adapters), by name."""
        host = self.Parameters(self.device.to_host(self.params.flat).copy())
        return {name: entry[0] for name, entry in self.TENSOR_TABLE(host).items()}

    def load_adapter_tensors(self, tensors, source):
        """The trainable tensors (a LoRA model's adapters) from `tensors`; the frozen ones stay."""
        host = self.Parameters(np.zeros(self.Parameters.SIZE, self.device.dtype))
        expected = {name: entry[0] for name, entry in self.TENSOR_TABLE(host).items()}
        check_tensors(tensors, expected, source, self.SPEC_NAME)
        for name, view in expected.items():
            view[...] = tensors[name]
        self.device.to_device(host.flat, self.params.flat)

    def to_safetensors(self, path):
        write_safetensors(
            path, {name: np.ascontiguousarray(t) for name, t in self.host_tensors().items()}
        )


def device_rope_tables(rope_tables_spec, max_seq_len, device):
    """(cos, sin) per RoPE table ((the RoPE base, half the head_dim it rotates, its scaling) each),
    (max_seq_len, half) on the device, in the device's dtype."""
    tables = []
    for theta, half, scaling in rope_tables_spec:
        cos = np.zeros((max_seq_len, half), device.dtype)
        sin = np.zeros((max_seq_len, half), device.dtype)
        rope_tables(cos, sin, theta, scaling)
        on_device = device.zeros(cos.shape), device.zeros(sin.shape)
        device.to_device(cos, on_device[0])
        device.to_device(sin, on_device[1])
        tables.append(on_device)
    return tables


class DecoderModel(Model):
    """A decoder over token ids (B, T): training, logits, and decoding with a KV cache.
    Subclasses also set `ROPE_TABLES`: (the RoPE base, half the head_dim it rotates, the scaling
    of its frequencies as a dict or None) per table, and `N_LAYERS`."""

    # Gradient checkpointing (`pyml train --recompute`): the training buffers keep what the
    # backward reads for one block instead of every block, and the backward runs each block's
    # forward again from its input in the residual stream. The same gradients, bit for bit.
    recompute = False

    def __init__(self, dtype=np.float32, device="cpu", maps=None):
        super().__init__(dtype, device, maps)
        self.rope = device_rope_tables(self.ROPE_TABLES, self.MAX_SEQ_LEN, self.device)
        self.token_weight_buffer = {}  # row count -> token_weight_buffers' pair

    @classmethod
    def table_bytes(cls, itemsize):
        # each RoPE table's cos and sin on the host and on the device, and the float64 angles
        # they are computed from
        return sum(cls.MAX_SEQ_LEN * half * (4 * itemsize + 8) for _, half, _ in cls.ROPE_TABLES)

    @classmethod
    def tables_described(cls):
        return f", and RoPE tables of {cls.MAX_SEQ_LEN:,} positions" if cls.ROPE_TABLES else ""

    def rope_table(self, index):
        """(cos, sin) of RoPE table `index`, (MAX_SEQ_LEN, half) on the device."""
        return self.rope[index]

    def buffers_for(self, B, T, every_layer=False):
        """(activations, gradients) for batch (B, T); the activations keep every layer's saved
        values unless `recompute` is on and `every_layer` (a prompt's keys and values for the
        cache) is not asked for."""
        if T > self.MAX_SEQ_LEN:
            raise PymlError(
                f"sequence length {T} exceeds the spec's max_seq_len {self.MAX_SEQ_LEN}"
            )
        kept = 1 if self.recompute and not every_layer else self.N_LAYERS
        # the buffers of the last BUFFER_SHAPES shapes used: training runs one shape, but a server
        # prefills prompts of every length, and keeping each one's buffers grows without end
        buffers = self.buffers.pop((B, T, kept), None) or (self.Activations(self.device, B, T, kept),
                                                           self.Gradients(self.device, B, T))
        self.buffers[(B, T, kept)] = buffers  # the most recent last
        while len(self.buffers) > BUFFER_SHAPES:
            del self.buffers[next(iter(self.buffers))]
        return buffers

    def load_batch(self, ids, out, what):
        ids = np.asarray(ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise PymlError(
                f"{what} must be a 2-D integer array (B, T), got {ids.dtype} {ids.shape}"
            )
        if ids.size:
            ignored = (ids == IGNORED_TARGET) if what == "targets" else np.zeros(ids.shape, bool)
            if ((ids < 0) & ~ignored).any() or ids.max() >= self.VOCAB:
                raise PymlError(f"{what} hold ids outside [0, {self.VOCAB})")
        self.device.to_device(ids.reshape(-1), out)

    def load_positions(self, positions, shape, out):
        """Each token's position in its example, (B, T): t by default (a row is one sequence). A
        row packing several examples counts 0, 1, 2, ... from each example's first token, and no
        token attends across them: each example computes what it would alone."""
        if positions is None:
            positions = np.broadcast_to(np.arange(shape[1], dtype=np.int64), shape)
        else:
            positions = np.asarray(positions)
            if positions.shape != tuple(shape) or not np.issubdtype(positions.dtype, np.integer):
                raise PymlError(f"positions must be a {tuple(shape)} integer array like input_ids, "
                                f"got {positions.dtype} {positions.shape}")
            following = positions[:, 1:]
            if positions.size and ((positions[:, 0] != 0).any() or (
                    (following != 0) & (following != positions[:, :-1] + 1)).any()):
                raise PymlError("positions must count 0, 1, 2, ... along each example of a row, "
                                "starting at 0 where a row or an example starts")
        self.device.to_device(positions, out)

    def forward(self, input_ids, positions=None):
        """Logits (B, T, VOCAB) as a host array; `positions` as `load_positions` says."""
        B, T = np.shape(input_ids)
        s, _ = self.buffers_for(B, T)
        self.load_batch(input_ids, s.ids, "input_ids")
        self.load_positions(positions, (B, T), s.positions)
        self.run_forward(s)
        return self.device.to_host(s.logits).reshape(B, T, self.VOCAB)

    def loss_and_grads(self, input_ids, targets, on_grads_ready=None, positions=None,
                       token_weights=None):
        """Mean cross-entropy of next-token `targets` (B, T); gradients land in `self.grads`.
        `on_grads_ready(i)` is called as soon as `grad_buckets[i]` is final; `positions` as
        `load_positions` says (rows packing several examples).

        `token_weights` makes the gradient that of a loss of the targets' log-probabilities (a
        preference loss, `pyml.train.preference`): called once, between this forward and the
        backward, with each target's log-probability under the current weights ((B, T) float64,
        0 where no target), it returns each target's weight (B, T): d loss / d its cross-entropy.
        One forward serves both. The mean cross-entropy is still what is returned."""
        if np.shape(targets) != np.shape(input_ids):
            raise PymlError(
                f"targets shape {np.shape(targets)} differs from input_ids shape {np.shape(input_ids)}"
            )
        B, T = np.shape(input_ids)
        s, g = self.buffers_for(B, T)
        self.load_batch(input_ids, s.ids, "input_ids")
        self.load_batch(targets, s.targets, "targets")
        self.load_positions(positions, (B, T), s.positions)
        self.run_forward(s)
        if token_weights is None:
            return self.run_loss_and_backward(s, g, on_grads_ready or no_bucket_hook)
        log_probs, weights = self.token_weight_buffers(B * T)
        self.device.kernels.target_log_probs(s.logits, s.targets, log_probs)
        chosen = np.asarray(token_weights(self.device.to_host(log_probs).reshape(B, T)), np.float64)
        if chosen.shape != (B, T):
            raise PymlError(f"token_weights returned {chosen.shape} weights for a ({B}, {T}) batch")
        self.device.to_device(np.ascontiguousarray(chosen).reshape(-1), weights)
        s.token_weights = weights
        try:
            return self.run_loss_and_backward(s, g, on_grads_ready or no_bucket_hook)
        finally:
            s.token_weights = None

    def target_log_probs(self, input_ids, targets, positions=None):
        """Each next-token target's log-probability (B, T) float64 (0 where no target), from a
        forward pass alone: what a sequence's log-probability sums (DPO's reference model)."""
        B, T = np.shape(input_ids)
        s, _ = self.buffers_for(B, T)
        self.load_batch(input_ids, s.ids, "input_ids")
        self.load_batch(targets, s.targets, "targets")
        self.load_positions(positions, (B, T), s.positions)
        self.run_forward(s)
        log_probs, _ = self.token_weight_buffers(B * T)
        self.device.kernels.target_log_probs(s.logits, s.targets, log_probs)
        return self.device.to_host(log_probs).reshape(B, T).copy()

    def token_weight_buffers(self, n_rows):
        """(target log-probabilities, token weights): two (n_rows,) float64 device buffers for
        `loss_and_grads(token_weights=...)`, made once per row count."""
        if n_rows not in self.token_weight_buffer:
            self.token_weight_buffer[n_rows] = (self.device.zeros(n_rows, np.float64),
                                                self.device.zeros(n_rows, np.float64))
        return self.token_weight_buffer[n_rows]

    def start_decoding(self, prompt_ids, max_len):
        """Run the prompt (B, T) through the model and return a cache for `max_len` positions
        holding its keys and values, with the logits (B, VOCAB) of its last position."""
        B, T = np.shape(prompt_ids)
        if max_len > self.MAX_SEQ_LEN:
            raise PymlError(f"{max_len} positions exceed the spec's max_seq_len {self.MAX_SEQ_LEN}")
        if T > max_len:
            raise PymlError(
                f"the prompt has {T} tokens, more than the {max_len} positions asked for"
            )
        s, _ = self.buffers_for(B, T, every_layer=True)  # fill_cache reads every layer's
        self.load_batch(prompt_ids, s.ids, "input_ids")
        self.load_positions(None, (B, T), s.positions)
        cache = self.DecodeBuffers(self.device, B, max_len)
        self.run_prompt(s, cache, T)
        self.fill_cache(s, cache, T)
        cache.length = T
        return cache, self.device.to_host(cache.logits).copy()

    def decode(self, cache, next_ids):
        """Append one token per sequence (`next_ids`, (B,)) and return its logits (B, VOCAB):
        the forward pass on one position, attending over the cache."""
        if cache.length >= cache.max_len:
            raise PymlError(f"the decoding cache is full ({cache.max_len} positions)")
        self.load_batch(np.reshape(next_ids, (-1, 1)), cache.ids, "next_ids")
        self.run_decode(cache, cache.length)
        cache.length += 1
        return self.device.to_host(cache.logits).copy()


class KVCache:
    """Keys and values of every attention layer: `keys[a][l]` is (B, slots, kv_heads, head_dim)
    for attention a of layer l. A global layer has a slot per position; a sliding-window layer
    holds only its window, position p in slot p % window (the softmax does not care about order)."""

    def __init__(self, device, B, max_len, attentions):
        self.max_len, self.length = max_len, 0
        self.windows = [attention["windows"] for attention in attentions]
        self.keys, self.values = [], []
        for attention in attentions:
            shapes = [(B, self.slot_count(window, max_len), attention["n_kv_heads"],
                       attention["head_dim"]) for window in attention["windows"]]
            self.keys.append([device.zeros(shape) for shape in shapes])
            self.values.append([device.zeros(shape) for shape in shapes])

    @staticmethod
    def slot_count(window, max_len):
        return min(window, max_len) if window else max_len

    def cache_slot(self, attention, layer, position):
        """(the slot position `position` is written to, how many slots hold positions)."""
        window = self.windows[attention][layer]
        if window:
            return position % window, min(position + 1, window)
        return position, position + 1

    def append(self, attention, layer, position, keys, values):
        """Write one new position's keys and values, (B, 1, kv_heads, head_dim), into their slot;
        (the layer's keys, its values, how many slots hold positions) for the attention."""
        slot, n_valid = self.cache_slot(attention, layer, position)
        layer_keys, layer_values = self.keys[attention][layer], self.values[attention][layer]
        layer_keys[:, slot] = keys[:, 0]
        layer_values[:, slot] = values[:, 0]
        return layer_keys, layer_values, n_valid

    def fill(self, attention, layer, keys, values, n_tokens):
        """Cache the prompt's keys and values, (B, T, kv_heads, head_dim), of positions
        0..n_tokens-1; a sliding layer keeps the last `window` of them. At most two contiguous
        copies per tensor (a window's slots wrap around once), so device arrays need no fancy
        indexing."""
        window = self.windows[attention][layer]
        first = max(0, n_tokens - window) if window else 0
        position = first
        while position < n_tokens:
            slot, _ = self.cache_slot(attention, layer, position)
            count = min(n_tokens - position, (window - slot) if window else n_tokens - position)
            for cache, source in ((self.keys, keys), (self.values, values)):
                cache[attention][layer][:, slot : slot + count] = source[
                    :, position : position + count
                ]
            position += count


class SequentialModel(Model):
    """A classifier over feature rows (B, INPUT_DIM)."""

    def buffers_for(self, B):
        if B not in self.buffers:
            self.buffers[B] = (
                self.Activations(self.device, B, 1),
                self.Gradients(self.device, B, 1),
            )
        return self.buffers[B]

    def load_inputs(self, inputs):
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or inputs.shape[1] != self.INPUT_DIM:
            raise PymlError(f"inputs must be (B, {self.INPUT_DIM}), got {inputs.shape}")
        if not np.isfinite(inputs).all():
            raise PymlError("inputs hold non-finite values")
        s, g = self.buffers_for(inputs.shape[0])
        self.device.to_device(inputs, s.inputs)
        return s, g

    def forward(self, inputs):
        """Logits (B, OUTPUT_DIM) as a host array."""
        s, _ = self.load_inputs(inputs)
        self.run_forward(s)
        return self.device.to_host(s.logits).copy()

    def loss_and_grads(self, inputs, targets, on_grads_ready=None):
        """Mean cross-entropy of class `targets` (B,); gradients land in `self.grads`.
        `on_grads_ready(i)` is called as soon as `grad_buckets[i]` is final."""
        targets = np.asarray(targets)
        if targets.shape != (np.shape(inputs)[0],) or not np.issubdtype(targets.dtype, np.integer):
            raise PymlError(
                f"targets must be ({np.shape(inputs)[0]},) integers, got {targets.dtype} {targets.shape}"
            )
        if targets.size and (targets.min() < 0 or targets.max() >= self.OUTPUT_DIM):
            raise PymlError(f"targets hold classes outside [0, {self.OUTPUT_DIM})")
        s, g = self.load_inputs(inputs)
        self.device.to_device(targets, s.targets)
        self.run_forward(s)
        return self.run_loss_and_backward(s, g, on_grads_ready or no_bucket_hook)


class AdamW:
    """torch.optim.AdamW's update (decoupled weight decay, bias correction, eps added after the
    square root), as one fused kernel over the flat parameter buffer."""

    def __init__(
        self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, max_grad_norm=None
    ):
        self.model = model
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.max_grad_norm = weight_decay, max_grad_norm
        size = model.params.flat.shape[0]
        require_memory(
            2 * size * model.device.dtype.itemsize, f"AdamW's state for {size:,} parameters"
        )
        self.exp_avg = model.device.zeros(size)
        self.exp_avg_sq = model.device.zeros(size)
        self.step_count = 0
        self.grad_norm = None  # the gradient's norm at the last step

    def step(self):
        k, grads = self.model.device.kernels, self.model.grads.flat
        # the norm before clipping, as torch.nn.utils.clip_grad_norm_ returns it (a run's metrics)
        self.grad_norm = k.adamw_grad_norm(grads)
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when below 1
            factor = self.max_grad_norm / (self.grad_norm + 1e-6)
            if factor < 1.0:
                k.adamw_scale(grads, factor)
        self.step_count += 1
        k.adamw_step(
            self.model.params.flat,
            grads,
            self.exp_avg,
            self.exp_avg_sq,
            self.lr,
            self.betas[0],
            self.betas[1],
            self.eps,
            self.weight_decay,
            self.step_count,
        )

    def state(self):
        """Host copies of the optimizer state, for checkpoints."""
        device = self.model.device
        return {
            "exp_avg": device.to_host(self.exp_avg),
            "exp_avg_sq": device.to_host(self.exp_avg_sq),
        }

    def load_state(self, state, step_count):
        self.model.device.to_device(state["exp_avg"], self.exp_avg)
        self.model.device.to_device(state["exp_avg_sq"], self.exp_avg_sq)
        self.step_count = step_count


def initial_tensors(table, seed):
    """Each tensor of `table` ({name: (view, init, fan_in)}) drawn as `Model.initialized` says,
    in the table's order from one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    host = {}
    for name, (view, init, fan_in) in table.items():
        if init == "normal":
            host[name] = rng.normal(0.0, 0.02, view.shape)
        elif init == "uniform":
            bound = 1.0 / math.sqrt(fan_in)
            host[name] = rng.uniform(-bound, bound, view.shape)
        else:
            host[name] = np.ones(view.shape) if init == "ones" else np.zeros(view.shape)
    return host


def train_step(model, optimizer, inputs, targets, slices=1, positions=None):
    """Loss and gradients, then one optimizer step; a non-finite loss leaves the weights as they
    were and raises. With `slices` > 1 the batch's rows go through the model that many at a time
    and their gradients are accumulated (`pyml.package.accumulate`): the same update, less memory.
    A decoder's `positions` say where packed examples start (`DecoderModel.load_positions`)."""
    loss = loss_and_grads(model, inputs, targets, slices, positions=positions)
    if not math.isfinite(loss):
        raise PymlError(
            f"non-finite loss ({loss}) at optimizer step {optimizer.step_count + 1}; "
            "weights left unchanged"
        )
    optimizer.step()
    return loss


def check_tensors(tensors, expected, source, spec_name):
    """Every expected tensor present with its shape; nothing unexpected."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise PymlError(
            f"{source}: missing tensor(s) {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise PymlError(
            f"{source}: unexpected tensor(s) {', '.join(unexpected[:3])} for spec '{spec_name}'"
        )
    for name, view in expected.items():
        if tuple(tensors[name].shape) != tuple(view.shape):
            raise PymlError(
                f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"spec '{spec_name}' expects {tuple(view.shape)}"
            )
