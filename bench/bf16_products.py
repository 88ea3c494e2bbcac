"""What AVX-512 BF16 gives this CPU for a training step's matrix products, before pyml builds bf16
training on it (issue 45: "measure and choose" the route to vdpbf16ps).

The route measured: a Numba intrinsic that writes the inner loop in LLVM IR with
`llvm.x86.avx512bf16.dpbf16ps.512` (as pyml/package/quantized_dot.py writes VNNI's vpdpbusd),
inside ordinary Numba loops; no C compiler, no new dependency. The prototype here:
- packs each operand into pairs of bf16 values (rounded to nearest even from float32, a NaN kept
  NaN), k-major: A in panels of 8 rows, B in panels of 32 columns;
- multiplies one 8 x 32 tile per call of the intrinsic: per pair of k, two loads of B, eight
  broadcasts of A, sixteen vdpbf16ps into sixteen float32 accumulators (checked in the assembly);
- runs the tiles of one panel of B on one thread (a parallel loop over B's panels), packing that
  panel first, so the packing is part of every timed product.

Compared, on the same float32 operands, 2 threads each, alternating, median of `--repeats`:
- numpy's float32 matmul (OpenBLAS sgemm), what pyml's training step runs today;
- the bf16 prototype (packing and rounding included);
- torch.matmul on operands already in bf16 (oneDNN, what CPU autocast runs; its conversion not
  timed, its output bf16).

Shapes: SmolLM2-135M's products at batch 2 x 128 (M = 256 rows) and 4 x 512 (M = 2048): a linear
layer's forward y = x W^T, its input gradient dX = G W and weight gradient dW = G^T X, for the
attention input (576 -> 960), the MLP's gate and up (576 -> 3072) and down (1536 -> 576) maps.
Each bf16 result is checked first against float64 products of the bf16-rounded operands.

    python bench/bf16_products.py [--repeats 15]

Results go to bench/results/bf16_products.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import pyml  # noqa: F401  (thread-pool settings before numpy and torch load their pools)
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MR, NR = 8, 32  # a tile: rows of A, columns of B (two vectors of 16 float32 lanes)
SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576)}  # (in, out)
ROWS = {"2x128": 256, "4x512": 2048}


class BFloatType(ir.Type):
    """LLVM's bfloat, which llvmlite's IR builder does not name."""

    def _to_string(self):
        return "bfloat"


I32, F32 = ir.IntType(32), ir.FloatType()
PAIRS_VECTOR, LANES, BF16_LANES = ir.VectorType(I32, 16), ir.VectorType(F32, 16), ir.VectorType(BFloatType(), 32)


def tile_codegen(context, builder, signature, args):
    a, a_at, b, b_at, pairs, tile = args
    a_type, _, b_type, _, _, tile_type = signature.args
    a_data = builder.gep(context.make_array(a_type)(context, builder, a).data, [a_at])
    b_data = builder.gep(context.make_array(b_type)(context, builder, b).data, [b_at])
    tile_data = context.make_array(tile_type)(context, builder, tile).data
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(LANES, [LANES, BF16_LANES, BF16_LANES]),
                                         "llvm.x86.avx512bf16.dpbf16ps.512")
    sums = [[cgutils.alloca_once_value(builder, ir.Constant(LANES, [0.0] * 16)) for _ in range(NR // 16)]
            for _ in range(MR)]
    undefined, first_lane = ir.Constant(PAIRS_VECTOR, ir.Undefined), ir.Constant(PAIRS_VECTOR, [0] * 16)
    with cgutils.for_range(builder, pairs) as loop:
        k = loop.index
        b_row = builder.gep(b_data, [builder.mul(k, ir.Constant(k.type, NR))])
        columns = [builder.bitcast(builder.load(builder.bitcast(builder.gep(b_row, [ir.Constant(k.type, 16 * j)]),
                                                               PAIRS_VECTOR.as_pointer()), align=4), BF16_LANES)
                   for j in range(NR // 16)]
        a_row = builder.gep(a_data, [builder.mul(k, ir.Constant(k.type, MR))])
        for m in range(MR):
            pair = builder.load(builder.gep(a_row, [ir.Constant(k.type, m)]))
            splat = builder.shuffle_vector(builder.insert_element(undefined, pair, ir.Constant(I32, 0)),
                                           undefined, first_lane)
            for j, column in enumerate(columns):
                total = builder.call(dot, [builder.load(sums[m][j]), builder.bitcast(splat, BF16_LANES), column])
                builder.store(total, sums[m][j])
    for m in range(MR):
        for j in range(NR // 16):
            at = builder.gep(tile_data, [ir.Constant(ir.IntType(64), m * NR + 16 * j)])
            builder.store(builder.load(sums[m][j]), builder.bitcast(at, LANES.as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic
def product_tile(typingctx, a, a_at, b, b_at, pairs, tile):
    """tile (MR * NR float32) := the MR x NR block of A B over `pairs` pairs of k: a[a_at:] holds
    A's pairs k-major (MR per pair), b[b_at:] B's (NR per pair); each uint32 two bf16 values, the
    lower k in the low half."""
    return types.none(a, a_at, b, b_at, pairs, tile), tile_codegen


@njit(inline="always")
def bf16_bits(bits):
    # the bf16 nearest (ties to even) to the float32 of these bits, as 16 bits; a NaN stays NaN
    if bits & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
        return (bits >> np.uint32(16)) | np.uint32(0x40)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(inline="always")
def pair_at(bits, line, k, across):
    # the pair (k, k + 1) of `line` (zeros past the end): k along a row, or across, down a column
    depth = bits.shape[0] if across else bits.shape[1]
    if across:
        low = bits[k, line] if k < depth else np.uint32(0)
        high = bits[k + 1, line] if k + 1 < depth else np.uint32(0)
    else:
        low = bits[line, k] if k < depth else np.uint32(0)
        high = bits[line, k + 1] if k + 1 < depth else np.uint32(0)
    return bf16_bits(low) | (bf16_bits(high) << np.uint32(16))


@njit
def pack_panel(bits, panel, width, lines, across, out):
    # out[kp * width + i] = the pair kp of line panel * width + i (zeros past the last line)
    pairs = out.shape[0] // width
    for kp in range(pairs):
        for i in range(width):
            line = panel * width + i
            out[kp * width + i] = pair_at(bits, line, 2 * kp, across) if line < lines else np.uint32(0)


@njit(parallel=True)
def bf16_product(a, a_across, b, b_across, c):
    """c (M, N) := A B, A's and B's values rounded to bf16, sums in float32. A is `a` (M, K), or
    a.T when a_across; B is `b` (K, N) when b_across, else b.T (b (N, K): a weight's rows)."""
    rows, columns = c.shape
    depth = a.shape[0] if a_across else a.shape[1]
    pairs = (depth + 1) // 2
    a_bits, b_bits = a.view(np.uint32), b.view(np.uint32)
    row_panels, column_panels = (rows + MR - 1) // MR, (columns + NR - 1) // NR
    a_packed = np.empty(row_panels * pairs * MR, np.uint32)
    for p in prange(row_panels):
        pack_panel(a_bits, p, MR, rows, a_across, a_packed[p * pairs * MR:(p + 1) * pairs * MR])
    for q in prange(column_panels):
        b_packed = np.empty(pairs * NR, np.uint32)
        pack_panel(b_bits, q, NR, columns, b_across, b_packed)
        tile = np.empty(MR * NR, np.float32)
        for p in range(row_panels):
            product_tile(a_packed, p * pairs * MR, b_packed, 0, pairs, tile)
            for i in range(min(MR, rows - p * MR)):
                for j in range(min(NR, columns - q * NR)):
                    c[p * MR + i, q * NR + j] = tile[i * NR + j]


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def products(rows: int, inputs: int, outputs: int, rng) -> dict:
    """Each product kind of one linear layer: (float32 operands, numpy's call, the bf16 call, the
    float64 reference of the bf16-rounded operands, torch's operands)."""
    x = rng.standard_normal((rows, inputs), dtype=np.float32)
    w = rng.standard_normal((outputs, inputs), dtype=np.float32) * np.float32(inputs ** -0.5)
    g = rng.standard_normal((rows, outputs), dtype=np.float32)
    return {
        "forward x W^T": ((rows, outputs), lambda y: np.matmul(x, w.T, out=y), lambda y: bf16_product(x, False, w, False, y),
                          lambda: bf16_rounded(x) @ bf16_rounded(w).T, (x, w.T)),
        "input grad G W": ((rows, inputs), lambda y: np.matmul(g, w, out=y), lambda y: bf16_product(g, False, w, True, y),
                           lambda: bf16_rounded(g) @ bf16_rounded(w), (g, w)),
        "weight grad G^T X": ((outputs, inputs), lambda y: np.matmul(g.T, x, out=y),
                              lambda y: bf16_product(g, True, x, True, y),
                              lambda: bf16_rounded(g).T @ bf16_rounded(x), (g.T, x)),
    }


def timed(call, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return seconds


def alternated(numpy_call, bf16_call, torch_operands, out, repeats: int) -> dict[str, list[float]]:
    """Every call's times: warmed, then 3 rounds of `repeats` each, the systems alternating."""
    import torch

    left, right = (torch.from_numpy(np.ascontiguousarray(t)).to(torch.bfloat16) for t in torch_operands)
    calls = {"numpy float32": lambda: numpy_call(out), "pyml bf16 prototype": lambda: bf16_call(out),
             "torch bf16": lambda: torch.matmul(left, right)}
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(3):
        for name, call in calls.items():
            times[name] += timed(call, repeats)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    options = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    rows_out = []
    for batch, rows in ROWS.items():
        for layer, (inputs, outputs) in SHAPES.items():
            for kind, (shape, numpy_call, bf16_call, reference, torch_operands) in products(
                    rows, inputs, outputs, rng).items():
                out = np.empty(shape, np.float32)
                bf16_call(out)
                expected = reference()
                error = float(np.abs(out - expected).max() / np.abs(expected).max())
                if error > 1e-5:
                    sys.exit(f"{batch} {layer} {kind}: the bf16 product is off by {error:.2e} (relative)")
                times = alternated(numpy_call, bf16_call, torch_operands, out, options.repeats)
                flops = 2.0 * rows * inputs * outputs  # the same for the three products
                row = {"batch": batch, "layer": layer, "product": kind, "shape": list(shape),
                       "relative_error": error}
                for name, seconds in times.items():
                    median = statistics.median(seconds)
                    row[name] = {"median_ms": 1e3 * median, "gflops": flops / median / 1e9}
                rows_out.append(row)
                print(f"{batch} {layer:8} {kind:18} " + "  ".join(
                    f"{name} {row[name]['median_ms']:7.2f} ms {row[name]['gflops']:5.0f} GF/s" for name in times))
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": 2, "repeats": options.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (RESULTS / "bf16_products.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1) + "\n")
    lines = ["# bf16 products on this CPU (bench/bf16_products.py)", "",
             f"{meta['date']}, 2 threads, median of {3 * options.repeats} per system (3 alternating rounds).", "",
             "| batch | layer | product | numpy float32 ms | pyml bf16 prototype ms | torch bf16 ms | bf16 / float32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows_out:
        ratio = row["pyml bf16 prototype"]["median_ms"] / row["numpy float32"]["median_ms"]
        lines.append(f"| {row['batch']} | {row['layer']} | {row['product']} | {row['numpy float32']['median_ms']:.2f} | "
                     f"{row['pyml bf16 prototype']['median_ms']:.2f} | {row['torch bf16']['median_ms']:.2f} | {ratio:.2f} |")
    (RESULTS / "bf16_products.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
