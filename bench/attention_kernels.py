"""The CPU attention kernels of the working tree against those of a git revision, at SmolLM2-135M's
shapes (B=2, T=128, 9 query heads, 3 kv heads, head_dim 64), float32, global attention (window 0):
a change to the kernels must not slow the path the shipped models take.

Each version runs in its own process from its own tree (the revision checked out in a temporary
git worktree), so that its templates render against its own shared kernels; the versions alternate,
one process per round: forward, backward and one decode step, best of --rounds rounds of --repeats
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
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = dict(p="attention", n_heads=9, n_kv_heads=3, head_dim=64, scale=0.125)
B, T = 2, 128


def measure(repeats: int, outputs: Path) -> None:
    """In this process, from the tree it runs in: time the calls, print the best times as JSON and
    save what they computed to `outputs`."""
    sys.path.insert(0, str(Path.cwd()))
    from pyml.codegen import render

    source = render.render_kernel_module("cpu", [("attention", CONTEXT)])
    path = Path(tempfile.gettempdir()) / "pyml-bench" / (
        f"attention_{hashlib.sha256(source.encode()).hexdigest()[:16]}.py")
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # numba's cache=True finds the module's globals by its name
    spec.loader.exec_module(module)

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
    # the window, and each token's position in its sequence where the kernels take them
    takes_positions = "positions" in inspect.signature(module.attention_forward).parameters
    masks = (0, np.tile(np.arange(T), (B, 1))) if takes_positions else (0,)
    calls = {
        "forward": lambda: module.attention_forward(q, k, v, att, out, *masks),
        "backward": lambda: module.attention_backward(q, k, v, att, dout, dq, dk, dv, *masks),
        "decode (300 cached)": lambda: module.attention_decode(q1, cache_k, cache_v, 300, out1),
    }
    for call in calls.values():  # compile
        call()
    np.savez(outputs, att=att, out=out, dqkv=dqkv, out1=out1)
    best = {}
    for name, call in calls.items():
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best[name] = (time.perf_counter() - start) / repeats
    print(json.dumps(best))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", default="bd971e2", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # a child: where to save
    args = parser.parse_args()
    if args.measure:
        measure(args.repeats, args.measure)
        return
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.rev], cwd=ROOT,
                       check=True)
        try:
            trees = {args.rev: base, "working tree": ROOT}
            best: dict[tuple[str, str], float] = {}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    saved = Path(scratch) / f"{'base' if tree == base else 'tree'}.npz"
                    child = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--repeats", str(args.repeats),
                         "--measure", str(saved)], cwd=tree, check=True, capture_output=True, text=True)
                    for call, seconds in json.loads(child.stdout.splitlines()[-1]).items():
                        best[name, call] = min(best.get((name, call), float("inf")), seconds)
            outputs = [np.load(Path(scratch) / f"{which}.npz") for which in ("base", "tree")]
            difference = max(float(np.abs(outputs[0][key] - outputs[1][key]).max())
                             for key in outputs[0].files)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=True)
    print(f"attention {CONTEXT} B={B} T={T} float32, best of {args.rounds} x {args.repeats}")
    print(f"largest difference between the versions' outputs: {difference:.3g}")
    for call in ("forward", "backward", "decode (300 cached)"):
        times = "  ".join(f"{name}: {best[name, call] * 1e3:.3f} ms" for name in trees)
        print(f"  {call:20s} {times}")
    sys.exit(0 if difference < 1e-4 else 1)


if __name__ == "__main__":
    main()
