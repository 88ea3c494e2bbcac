"""Prototype, hand-written and not generated: SmolLM2's whole decode step as one Numba function on
the GGUF's quantized weights, measured against llama.cpp in the same run.

What the generated fused decode step (issue 15, phase 2) must do, tried here first: the weights
kept as the GGUF stores them (Q4_1 projections, the tied Q8_0 embedding as the LM head) through
the quantized linear kernels' row dot products (pyml/package/quantized_dot.py), the layer loop inside Numba, the KV cache written in place,
every buffer allocated once, no BLAS. The prompt goes through the same step token by token (the
generated version will prefill through matrix-matrix products instead).

Checked in the run: the prototype's greedy tokens against pyml's float32 path (the generated
package: the same weights, dequantized) and the largest logit difference on the prompt's last
position. Reported: prefill and decode tokens/s of both, and of llama.cpp when llama-cpp-python is
importable, each system in a process of its own, median of `--repeats` runs after a warm-up.

    python bench/fused_decode_prototype.py [--new-tokens 64] [--repeats 3] [--threads N]
                                           [--spin-count N]

`--threads N` runs every system on N threads (default: all cores; on a machine shared with other
work, `--threads 1` compares the systems' cost per core).

`--spin-count N` starts the prototype's process with GOMP_SPINCOUNT=N (and OMP_WAIT_POLICY=ACTIVE,
so that pyml leaves the policy alone; a given GOMP_SPINCOUNT sets libgomp's spin count whatever the
policy): libgomp's threads then spin N rounds (about 10 ns each) before they sleep, which the step's
~150 parallel regions per token can use; pyml's policy, PASSIVE, puts them to sleep after each.
"""

from __future__ import annotations

import os

START_ENVIRONMENT = dict(os.environ)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

import numba  # noqa: E402
import numpy as np  # noqa: E402
from generate import PROMPT, llamacpp_model, llamacpp_run  # noqa: E402  (bench/ is on sys.path: run as a script)
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from pyml.package.quantized_dot import q4_row_dot_runs_of_16 as q4_row_dot  # noqa: E402
from pyml.package.quantized_dot import q8_row_dot  # noqa: E402
from pyml.package.vector_math import exp_vectorizable, sigmoid_vectorizable  # noqa: E402

FAST = {"contract", "reassoc"}


@njit(parallel=True, fastmath=FAST, cache=True)
def q4_matvec(values, scale, offset, x, y):
    # y (rows,) = W x, x is (1, in)
    for row in prange(values.shape[0]):
        y[row] = q4_row_dot(values, scale, offset, x, row, 0)


@njit(parallel=True, fastmath=FAST, cache=True)
def q8_matvec(values, scale, x, y):
    for row in prange(values.shape[0]):
        y[row] = q8_row_dot(values, scale, x, row, 0)


@njit(cache=True)
def rmsnorm(x, w, eps, y):
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * np.float64(x[i])
    r = np.float32(1.0 / math.sqrt(total / x.shape[0] + eps))
    for i in range(x.shape[0]):
        y[0, i] = w[i] * (x[i] * r)


@njit(cache=True)
def rope(vector, heads, head_dim, cos, sin, position):
    # the heads of `vector` (heads * head_dim,) rotated in place: pairs (i, i + head_dim / 2)
    half = head_dim // 2
    for h in range(heads):
        base = h * head_dim
        for i in range(half):
            x1, x2 = vector[base + i], vector[base + i + half]
            vector[base + i] = x1 * cos[position, i] - x2 * sin[position, i]
            vector[base + i + half] = x2 * cos[position, i] + x1 * sin[position, i]


@njit(parallel=True, fastmath=FAST, cache=True)
def attention(q, k_cache, v_cache, length, n_heads, n_kv_heads, head_dim, scores, out):
    # out (1, n_heads * head_dim): each head's softmax(q k^T / sqrt(d)) v over positions
    # 0..length-1, in three vectorizable passes over its row of scores (n_heads, max_len): the
    # online softmax (one pass, rescaling on each new maximum) measured 1.7x slower here
    group = n_heads // n_kv_heads
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for h in prange(n_heads):
        g, base = h // group, h * head_dim
        q_head, row = q[base:base + head_dim], scores[h, :length]
        for j in range(length):
            key = k_cache[j, g]
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q_head[d] * key[d]
            row[j] = s * scale
        row_max = row[0]
        for j in range(1, length):
            row_max = max(row_max, row[j])
        total = np.float32(0.0)
        for j in range(length):
            row[j] = exp_vectorizable(row[j] - row_max)
            total += row[j]
        inverse = np.float32(1.0) / total
        attended = out[0, base:base + head_dim]
        attended[:] = 0.0
        for j in range(length):
            p, value = row[j] * inverse, v_cache[j, g]
            for d in range(head_dim):
                attended[d] += p * value[d]


@njit(cache=True)
def decode_step(token, position, eps, n_heads, n_kv_heads, head_dim,
                embed_values, embed_scale, attn_norm, qkv_values, qkv_scale, qkv_offset,
                o_values, o_scale, o_offset, mlp_norm, gate_up_values, gate_up_scale,
                gate_up_offset, down_values, down_scale, down_offset, final_norm,
                k_cache, v_cache, cos, sin, x, normed, qkv, scores, attended, out, gate_up, hidden,
                logits):
    """Logits of `token` at `position`; writes its keys and values into the caches in place.
    Weights are stacked by layer (L, rows, ...); caches are (L, max_len, kv heads, head dim)."""
    dim = x.shape[0]
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    hidden_dim = hidden.shape[1]
    for i in range(dim):  # the embedding row, dequantized from Q8_0
        x[i] = np.float32(embed_values[token, i]) * embed_scale[token, i // 32]
    for layer in range(attn_norm.shape[0]):
        rmsnorm(x, attn_norm[layer], eps, normed)
        q4_matvec(qkv_values[layer], qkv_scale[layer], qkv_offset[layer], normed, qkv)
        rope(qkv[:q_dim], n_heads, head_dim, cos, sin, position)
        rope(qkv[q_dim:q_dim + kv_dim], n_kv_heads, head_dim, cos, sin, position)
        for i in range(kv_dim):
            k_cache[layer, position, i // head_dim, i % head_dim] = qkv[q_dim + i]
            v_cache[layer, position, i // head_dim, i % head_dim] = qkv[q_dim + kv_dim + i]
        attention(qkv[:q_dim], k_cache[layer], v_cache[layer], position + 1, n_heads, n_kv_heads,
                  head_dim, scores, attended)
        q4_matvec(o_values[layer], o_scale[layer], o_offset[layer], attended, out)
        for i in range(dim):
            x[i] += out[i]
        rmsnorm(x, mlp_norm[layer], eps, normed)
        q4_matvec(gate_up_values[layer], gate_up_scale[layer], gate_up_offset[layer], normed, gate_up)
        for i in range(hidden_dim):
            g = gate_up[i]
            hidden[0, i] = g * sigmoid_vectorizable(g) * gate_up[hidden_dim + i]
        q4_matvec(down_values[layer], down_scale[layer], down_offset[layer], hidden, out)
        for i in range(dim):
            x[i] += out[i]
    rmsnorm(x, final_norm, eps, normed)
    q8_matvec(embed_values, embed_scale, normed, logits)


# --- the same step as one parallel region per token: a worker per thread, the ops' rows (heads,
# hidden units) split between the workers, the phases separated by a barrier on atomic counters
# instead of a fork and a join of the thread pool per op.


@intrinsic
def atomic_add(typingctx, array, index, value):
    """array[index] += value atomically (sequentially consistent); the old value."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), args[2], "seq_cst")

    return types.int64(array, index, value), codegen


@intrinsic
def atomic_read(typingctx, array, index):
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "seq_cst", 8)

    return types.int64(array, index), codegen


libc = ctypes.CDLL(None)
sched_yield = libc.sched_yield
sched_yield.restype, sched_yield.argtypes = ctypes.c_int, []
SPINS_BEFORE_YIELD = 2000


@njit(cache=True)
def barrier(sync, workers):
    # sync = [arrived, generation] (int64): the last worker to arrive resets the count and starts
    # the next generation; the others spin on the generation, yielding the core after a while so
    # that a descheduled worker can run (this machine is shared)
    generation = atomic_read(sync, 1)
    if atomic_add(sync, 0, np.int64(1)) == workers - 1:
        atomic_add(sync, 0, np.int64(-workers))
        atomic_add(sync, 1, np.int64(1))
        return
    spins = 0
    while atomic_read(sync, 1) == generation:
        spins += 1
        if spins > SPINS_BEFORE_YIELD:
            sched_yield()


@njit(cache=True)
def share(count, worker, workers):
    return count * worker // workers, count * (worker + 1) // workers


@njit(fastmath=FAST, cache=True)
def q4_rows(values, scale, offset, x, y, worker, workers):
    start, stop = share(values.shape[0], worker, workers)
    for row in range(start, stop):
        y[row] = q4_row_dot(values, scale, offset, x, row, 0)


@njit(fastmath=FAST, cache=True)
def attention_head(q, k_cache, v_cache, length, h, group, head_dim, scores, out):
    g, base = h // group, h * head_dim
    scale = np.float32(1.0 / math.sqrt(head_dim))
    q_head, row = q[base:base + head_dim], scores[h, :length]
    for j in range(length):
        key = k_cache[j, g]
        s = np.float32(0.0)
        for d in range(head_dim):
            s += q_head[d] * key[d]
        row[j] = s * scale
    row_max = row[0]
    for j in range(1, length):
        row_max = max(row_max, row[j])
    total = np.float32(0.0)
    for j in range(length):
        row[j] = exp_vectorizable(row[j] - row_max)
        total += row[j]
    inverse = np.float32(1.0) / total
    attended = out[0, base:base + head_dim]
    attended[:] = 0.0
    for j in range(length):
        p, value = row[j] * inverse, v_cache[j, g]
        for d in range(head_dim):
            attended[d] += p * value[d]


@njit(fastmath=FAST, cache=True)
def decode_worker(worker, workers, sync, token, position, eps, n_heads, n_kv_heads, head_dim,
                  embed_values, embed_scale, attn_norm, qkv_values, qkv_scale, qkv_offset,
                  o_values, o_scale, o_offset, mlp_norm, gate_up_values, gate_up_scale,
                  gate_up_offset, down_values, down_scale, down_offset, final_norm,
                  k_cache, v_cache, cos, sin, x, normed, qkv, scores, attended, out, gate_up,
                  hidden, logits):
    dim = x.shape[0]
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    hidden_dim = hidden.shape[1]
    if worker == 0:
        for i in range(dim):
            x[i] = np.float32(embed_values[token, i]) * embed_scale[token, i // 32]
        rmsnorm(x, attn_norm[0], eps, normed)
    barrier(sync, workers)
    for layer in range(attn_norm.shape[0]):
        q4_rows(qkv_values[layer], qkv_scale[layer], qkv_offset[layer], normed, qkv, worker, workers)
        barrier(sync, workers)
        if worker == 0:
            rope(qkv[:q_dim], n_heads, head_dim, cos, sin, position)
            rope(qkv[q_dim:q_dim + kv_dim], n_kv_heads, head_dim, cos, sin, position)
            for i in range(kv_dim):
                k_cache[layer, position, i // head_dim, i % head_dim] = qkv[q_dim + i]
                v_cache[layer, position, i // head_dim, i % head_dim] = qkv[q_dim + kv_dim + i]
        barrier(sync, workers)
        first, last = share(n_heads, worker, workers)
        for h in range(first, last):
            attention_head(qkv[:q_dim], k_cache[layer], v_cache[layer], position + 1, h,
                           n_heads // n_kv_heads, head_dim, scores, attended)
        barrier(sync, workers)
        q4_rows(o_values[layer], o_scale[layer], o_offset[layer], attended, out, worker, workers)
        barrier(sync, workers)
        if worker == 0:
            for i in range(dim):
                x[i] += out[i]
            rmsnorm(x, mlp_norm[layer], eps, normed)
        barrier(sync, workers)
        q4_rows(gate_up_values[layer], gate_up_scale[layer], gate_up_offset[layer], normed,
                gate_up, worker, workers)
        barrier(sync, workers)
        first, last = share(hidden_dim, worker, workers)
        for i in range(first, last):
            g = gate_up[i]
            hidden[0, i] = g * sigmoid_vectorizable(g) * gate_up[hidden_dim + i]
        barrier(sync, workers)
        q4_rows(down_values[layer], down_scale[layer], down_offset[layer], hidden, out, worker,
                workers)
        barrier(sync, workers)
        if worker == 0:
            for i in range(dim):
                x[i] += out[i]
            rmsnorm(x, attn_norm[layer + 1] if layer + 1 < attn_norm.shape[0] else final_norm,
                    eps, normed)
        barrier(sync, workers)
    first, last = share(logits.shape[0], worker, workers)
    for row in range(first, last):
        logits[row] = q8_row_dot(embed_values, embed_scale, normed, row, 0)


@njit(parallel=True, cache=True)
def decode_step_workers(sync, token, position, eps, n_heads, n_kv_heads, head_dim, *arrays):
    workers = numba.get_num_threads()
    for worker in prange(workers):  # one iteration per thread: all of them run at once
        decode_worker(worker, workers, sync, token, position, eps, n_heads, n_kv_heads, head_dim,
                      *arrays)


class Prototype:
    """The shipped SmolLM2 GGUF's weights, quantized, stacked by layer, and the step's buffers."""

    def __init__(self, max_len: int, workers: bool):
        from pyml.runtime.gguf_architectures import Llama, unpermute_rotary_rows
        from pyml.runtime.gguf_quantized import quantized_matrix
        from pyml.runtime.gguf_read import read_gguf
        from pyml.runtime.smollm2_gguf import shipped_gguf_path

        gguf = read_gguf(shipped_gguf_path())
        self.dims = dims = Llama(gguf).dims

        def matrix(name, heads=None):
            tensor = gguf.tensors[name]
            quantized = quantized_matrix(np.asarray(tensor.data), int(tensor.ggml_type), tensor.shape)
            if heads:  # llama.cpp's rotary row order back to Hugging Face's
                order = unpermute_rotary_rows(np.arange(tensor.shape[0])[:, None], heads)[:, 0]
                quantized = quantized.rows(order)
            return quantized.arrays

        def stacked(*names_and_heads):
            # one projection of every layer, the parts' rows one after another: (L, rows, ...)
            layers = []
            for layer in range(dims.n_layers):
                parts = [matrix(f"blk.{layer}.{name}", heads) for name, heads in names_and_heads]
                layers.append([np.concatenate(arrays) for arrays in zip(*parts)])
            return [np.ascontiguousarray(np.stack(arrays)) for arrays in zip(*layers)]

        def vector(name):
            return np.stack([np.asarray(gguf.tensors[f"blk.{layer}.{name}"].data).view("<f4")
                             for layer in range(dims.n_layers)]).astype(np.float32)

        self.embed = matrix("token_embd.weight")
        self.qkv = stacked(("attn_q.weight", dims.n_heads), ("attn_k.weight", dims.n_kv_heads),
                           ("attn_v.weight", None))
        self.o = stacked(("attn_output.weight", None))
        self.gate_up = stacked(("ffn_gate.weight", None), ("ffn_up.weight", None))
        self.down = stacked(("ffn_down.weight", None))
        self.attn_norm, self.mlp_norm = vector("attn_norm.weight"), vector("ffn_norm.weight")
        self.final_norm = np.asarray(gguf.tensors["output_norm.weight"].data).view("<f4").copy()
        from gen.smollm2_135m import kernels_cpu  # the float32 package's rope tables, bit for bit

        half = dims.head_dim // 2
        self.cos = np.zeros((kernels_cpu.ROPE_TABLE0_MAX_SEQ_LEN, half), np.float32)
        self.sin = np.zeros_like(self.cos)
        kernels_cpu.rope_table0_tables(self.cos, self.sin)
        kv = (dims.n_layers, max_len, dims.n_kv_heads, dims.head_dim)
        self.k_cache, self.v_cache = np.zeros(kv, np.float32), np.zeros(kv, np.float32)
        q_dim, kv_dim = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
        self.x, self.normed = np.zeros(dims.hidden, np.float32), np.zeros((1, dims.hidden), np.float32)
        self.qkv_out = np.zeros(q_dim + 2 * kv_dim, np.float32)
        self.scores = np.zeros((dims.n_heads, max_len), np.float32)
        self.attended, self.out = np.zeros((1, q_dim), np.float32), np.zeros(dims.hidden, np.float32)
        self.gate_up_out = np.zeros(2 * dims.ffn, np.float32)
        self.hidden = np.zeros((1, dims.ffn), np.float32)
        self.logits = np.zeros(dims.vocab, np.float32)
        self.workers, self.sync = workers, np.zeros(2, np.int64)

    @property
    def weight_bytes(self) -> int:
        arrays = [*self.embed, *self.qkv, *self.o, *self.gate_up, *self.down]
        return sum(array.nbytes for array in arrays)

    def arrays(self):
        return (*self.embed, self.attn_norm, *self.qkv, *self.o, self.mlp_norm, *self.gate_up,
                *self.down, self.final_norm, self.k_cache, self.v_cache, self.cos, self.sin,
                self.x, self.normed, self.qkv_out, self.scores, self.attended, self.out,
                self.gate_up_out, self.hidden, self.logits)

    def step(self, token: int, position: int) -> np.ndarray:
        d = self.dims
        if self.workers:
            decode_step_workers(self.sync, token, position, d.rms_norm_eps, d.n_heads,
                                d.n_kv_heads, d.head_dim, *self.arrays())
            return self.logits
        decode_step(token, position, d.rms_norm_eps, d.n_heads, d.n_kv_heads, d.head_dim,
                    *self.embed, self.attn_norm, *self.qkv, *self.o, self.mlp_norm, *self.gate_up,
                    *self.down, self.final_norm, self.k_cache, self.v_cache, self.cos, self.sin,
                    self.x, self.normed, self.qkv_out, self.scores, self.attended, self.out, self.gate_up_out,
                    self.hidden, self.logits)
        return self.logits


def prototype_run(model: Prototype, ids, new_tokens, stop):
    started = time.perf_counter()
    for position, token in enumerate(ids):
        logits = model.step(token, position)
    prefill = time.perf_counter() - started
    last_prompt_logits = logits.copy()
    out = [int(np.argmax(logits))]
    started = time.perf_counter()
    while len(out) < new_tokens and out[-1] not in stop:
        out.append(int(np.argmax(model.step(out[-1], len(ids) + len(out) - 1))))
    return out, prefill, time.perf_counter() - started, last_prompt_logits


def float32_reference(ids, new_tokens, stop) -> tuple[np.ndarray, list[int]]:
    """pyml's float32 path (the generated package, whose greedy tokens bench/generate.py checks
    against transformers'): the logits of the prompt's last position, and the greedy tokens."""
    from generate import ours_run
    from train_step import ensure_model

    from pyml.runtime import generate as generation

    model = generation.load_model(ensure_model(), ROOT / "specs" / "smollm2_135m.toml")
    _, logits = model.start_decoding(np.array([ids]), len(ids))
    return logits[0], ours_run(model, ids, new_tokens, stop)[0]


def run_system(system: str, new_tokens: int, repeats: int, threads: int) -> dict:
    from train_step import ensure_model

    from pyml.runtime import generate as generation

    model_dir = ensure_model()
    tokenizer = generation.load_tokenizer(model_dir)
    ids = generation.prompt_ids(model_dir, tokenizer, PROMPT, chat=True)
    stop = generation.eos_ids(model_dir)
    extra = {}
    if system in ("fork_join", "workers"):
        model = Prototype(len(ids) + new_tokens, workers=system == "workers")
        extra["weight_mib"] = model.weight_bytes / 2**20
        run = lambda: prototype_run(model, ids, new_tokens, stop)  # noqa: E731
    else:
        model = llamacpp_model(len(ids) + new_tokens, len(ids), threads)
        run = lambda: (*llamacpp_run(model, ids, new_tokens, stop), None)  # noqa: E731
    runs = []
    for repeat in range(repeats + 1):  # the first run warms up (and compiles)
        out, prefill, decode, last_logits = run()
        if repeat:
            runs.append((len(ids) / prefill, (len(out) - 1) / decode, 1e3 * decode / (len(out) - 1)))
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if system != "llamacpp":  # after the peak memory is read: the float32 model is larger
        reference, reference_tokens = float32_reference(ids, new_tokens, stop)
        extra["max_logit_difference_to_float32"] = float(np.max(np.abs(last_logits - reference)))
        extra["tokens_equal_to_float32"] = out == reference_tokens
    return {"prompt_tokens": len(ids), "tokens": out,
            "prefill_tokens_per_s": statistics.median(r[0] for r in runs),
            "decode_tokens_per_s": statistics.median(r[1] for r in runs),
            "decode_ms_per_token": [round(r[2], 2) for r in runs],
            "peak_rss_mib": peak_rss_mib, **extra}


SYSTEMS = {"fork_join": "prototype, a parallel region per op",
           "workers": "prototype, one region per token, barriers",
           "llamacpp": "llama.cpp (llama-cpp-python 0.3.36)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="processes per system, in turn")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--spin-count", type=int)
    parser.add_argument("--system", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        print(json.dumps(run_system(args.system, args.new_tokens, args.repeats, args.threads)))
        return
    systems = [name for name in SYSTEMS if name != "llamacpp" or importlib.util.find_spec("llama_cpp")]
    runs = {system: [] for system in systems}
    for _ in range(args.rounds):  # systems in turn, so that a change in the machine's load hits all
        for system in systems:
            environment = dict(START_ENVIRONMENT, NUMBA_NUM_THREADS=str(args.threads))
            if system == "fork_join" and args.spin_count is not None:
                environment["OMP_WAIT_POLICY"] = "ACTIVE"  # set: pyml leaves it, GOMP_SPINCOUNT rules
                environment["GOMP_SPINCOUNT"] = str(args.spin_count)
            child = subprocess.run([sys.executable, __file__, "--system", system, "--new-tokens",
                                    str(args.new_tokens), "--repeats", str(args.repeats),
                                    "--threads", str(args.threads)],
                                   env=environment, capture_output=True, text=True)
            if child.returncode != 0:
                raise SystemExit(f"error: the {system} run failed: {child.stderr.strip()[-2000:]}")
            runs[system].append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"SmolLM2-135M-Instruct, {runs[systems[0]][0]['prompt_tokens']} prompt tokens, "
          f"{args.new_tokens} new tokens, greedy, {args.threads} thread(s), {args.rounds} processes "
          f"per system x {args.repeats} timed runs"
          + (f", GOMP_SPINCOUNT={args.spin_count} for the fork-join prototype" if args.spin_count is not None else ""))
    print("\n| system | decode tokens/s (median) | best ms/token | prefill tokens/s | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- |")
    for system, results in runs.items():
        decode = statistics.median(r["decode_tokens_per_s"] for r in results)
        best = min(min(r["decode_ms_per_token"]) for r in results)
        prefill = statistics.median(r["prefill_tokens_per_s"] for r in results)
        print(f"| {SYSTEMS[system]} | {decode:.1f} | {best:.2f} | {prefill:.1f} | "
              f"{max(r['peak_rss_mib'] for r in results):.0f} |")
    prototype = runs[systems[0]][0]
    same = all(r["tokens"] == prototype["tokens"] for system in ("fork_join", "workers") for r in runs[system])
    print(f"\nBoth prototypes' tokens identical: {same}; equal to pyml's float32 path's greedy tokens: "
          f"{prototype['tokens_equal_to_float32']}; largest logit difference to it on the prompt's last "
          f"position: {prototype['max_logit_difference_to_float32']:.2e}; quantized weights read per "
          f"token: {prototype['weight_mib']:.0f} MiB.")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
