"""What AVX-512 BF16 gives this CPU for a training step's matrix products (issue 45): pyml's bf16
kernel (`pyml/package/bf16_products.py`, what `pyml train --precision bf16` runs) against numpy's
float32 and torch's bf16 on the same operands.

The route was chosen here: a first version of this script held a prototype (a Numba intrinsic
emitting `llvm.x86.avx512bf16.dpbf16ps.512` in 8 x 32 tiles, operands packed and rounded each
call) and measured it at 0.38-0.92x numpy's float32 time, which settled on that route over a C
kernel or oneDNN; the prototype became the shipped kernel, which this script now measures.

Compared, on the same float32 operands, 2 threads each, alternating, median of `--repeats`:
- numpy's float32 matmul (OpenBLAS sgemm), what pyml's float32 training step runs;
- pyml's bf16 product (packing and rounding included);
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

from pyml.package.bf16_products import bf16_product

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576)}  # (in, out)
ROWS = {"2x128": 256, "4x512": 2048}


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
        "forward x W^T": ((rows, outputs), lambda y: np.matmul(x, w.T, out=y), lambda y: bf16_product(x, False, w, False, y, False),
                          lambda: bf16_rounded(x) @ bf16_rounded(w).T, (x, w.T)),
        "input grad G W": ((rows, inputs), lambda y: np.matmul(g, w, out=y), lambda y: bf16_product(g, False, w, True, y, False),
                           lambda: bf16_rounded(g) @ bf16_rounded(w), (g, w)),
        "weight grad G^T X": ((outputs, inputs), lambda y: np.matmul(g.T, x, out=y),
                              lambda y: bf16_product(g, True, x, True, y, False),
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
    calls = {"numpy float32": lambda: numpy_call(out), "pyml bf16": lambda: bf16_call(out),
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
             "| batch | layer | product | numpy float32 ms | pyml bf16 ms | torch bf16 ms | pyml bf16 / float32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows_out:
        ratio = row["pyml bf16"]["median_ms"] / row["numpy float32"]["median_ms"]
        lines.append(f"| {row['batch']} | {row['layer']} | {row['product']} | {row['numpy float32']['median_ms']:.2f} | "
                     f"{row['pyml bf16']['median_ms']:.2f} | {row['torch bf16']['median_ms']:.2f} | {ratio:.2f} |")
    (RESULTS / "bf16_products.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
