"""The CPU attention kernels of the working tree against those of a git revision, at SmolLM2-135M's
shapes (B=2, T=128, 9 query heads, 3 kv heads, head_dim 64), float32, global attention (window 0):
a change to the templates must not slow the path the shipped models take.

Both versions are rendered from their templates with the spec's dims, imported into this process
and timed alternately: forward, backward and one decode step; best of --rounds rounds of --repeats
calls each (these machines are shared: single runs vary by tens of percent). q, k and v are views
of one fused (B, T, 15, 64) qkv array, as the generated model passes them. The largest difference
between the two versions' outputs is printed; it must stay at float32 rounding.

    python bench/attention_kernels.py [--rev bd971e2] [--rounds 7] [--repeats 10]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jinja2
import numpy as np

from pyml.codegen import render

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = dict(p="attention", n_heads=9, n_kv_heads=3, head_dim=64, scale=0.125)
B, T = 2, 128


TEMPLATE_FOLDERS = ("pyml/codegen/templates", "pyml/codegen/kinds")  # where a revision keeps them


def templates_at(rev: str, into: Path) -> list[Path]:
    """The kernel template folders of git revision `rev`, extracted under `into`."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, *TEMPLATE_FOLDERS], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split()
    archive = subprocess.run(["git", "archive", rev, *listed], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return [into / folder for folder in listed]


def load(templates: list[Path], name: str):
    render.ENVIRONMENT = render.ENVIRONMENT.overlay(loader=jinja2.FileSystemLoader(templates))
    source = render.render_kernel_module("cpu", [("attention", CONTEXT)])
    path = Path(tempfile.gettempdir()) / "pyml-bench" / (
        f"{name}_{hashlib.sha256(source.encode()).hexdigest()[:16]}.py")
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # numba's cache=True finds the module's globals by its name
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", default="fe75df9", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        versions = {args.rev: load(templates_at(args.rev, Path(scratch)), "base"),
                    "working tree": load([ROOT / folder for folder in TEMPLATE_FOLDERS], "tree")}
    h, kv, hd = CONTEXT["n_heads"], CONTEXT["n_kv_heads"], CONTEXT["head_dim"]
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, h + 2 * kv, hd)).astype(np.float32)
    q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kv], qkv[:, :, h + kv :]
    dout = rng.standard_normal((B, T, h * hd)).astype(np.float32)
    att, out = np.empty((B, h, T, T), np.float32), np.empty((B, T, h * hd), np.float32)
    dqkv = np.empty_like(qkv)
    dq, dk, dv = dqkv[:, :, :h], dqkv[:, :, h : h + kv], dqkv[:, :, h + kv :]
    cache_k, cache_v = (rng.standard_normal((B, 512, kv, hd)).astype(np.float32) for _ in range(2))
    q1, out1 = np.ascontiguousarray(q[:, -1:]), np.empty((B, 1, h * hd), np.float32)
    positions = np.tile(np.arange(T), (B, 1))  # one sequence per row

    def masks(m) -> tuple:
        # the window, and the positions of tokens in their examples where the kernels take them
        takes_positions = "positions" in inspect.signature(m.attention_forward).parameters
        return (0, positions) if takes_positions else (0,)

    calls = {
        "forward": lambda m: m.attention_forward(q, k, v, att, out, *masks(m)),
        "backward": lambda m: m.attention_backward(q, k, v, att, dout, dq, dk, dv, *masks(m)),
        "decode (300 cached)": lambda m: m.attention_decode(q1, cache_k, cache_v, 300, out1),
    }
    outputs = {}
    for name, module in versions.items():  # compile, and keep what each computes
        for call in calls.values():
            call(module)
        outputs[name] = [a.copy() for a in (att, out, dqkv, out1)]
    difference = max(float(np.abs(a - b).max()) for a, b in zip(*outputs.values()))
    best = {(name, call): float("inf") for name in versions for call in calls}
    for _ in range(args.rounds):
        for name, module in versions.items():
            for call_name, call in calls.items():
                start = time.perf_counter()
                for _ in range(args.repeats):
                    call(module)
                elapsed = (time.perf_counter() - start) / args.repeats
                best[name, call_name] = min(best[name, call_name], elapsed)
    print(f"attention {CONTEXT} B={B} T={T} float32, best of {args.rounds} x {args.repeats}")
    print(f"largest difference between the versions' outputs: {difference:.3g}")
    for call_name in calls:
        times = "  ".join(f"{name}: {best[name, call_name] * 1e3:.3f} ms" for name in versions)
        print(f"  {call_name:20s} {times}")
    sys.exit(0 if difference < 1e-4 else 1)


if __name__ == "__main__":
    main()
