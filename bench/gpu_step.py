"""The CUDA path's speed on a GPU (issue 46): pyml's training step and decoding on device="cuda"
against PyTorch eager on the same GPU and against pyml on the same machine's CPU.

Protocol: the SmolLM2-135M spec (specs/smollm2_135m.toml) with random weights (seed 0: a lent GPU
machine has no shipped GGUF and reaches no hub, and a step's time does not depend on the values),
float32. PyTorch eager runs the same weights (pyml's `to_safetensors`) in transformers'
LlamaForCausalLM (sdpa attention), with torch.optim.AdamW's settings of bench/train_step.py.
Batches of random token ids, 2 x 128 and 16 x 512. Systems, all in this one process, each timed
over its own steps after warm-up steps (the first compiles Numba's kernels):

- pyml on the GPU, its products through each route of PYML_CUDA_PRODUCTS (pyml/package/cuda_products.py):
  the tiled kernel, and cuBLAS through CuPy where CuPy imports;
- PyTorch eager on the GPU, in float32; torch's TF32 settings are reported as found (its default
  is no TF32 for float32 products), and CuPy's cuBLAS route is float32 unless CUPY_TF32=1;
- pyml on the CPU, at 2 x 128 only (the anchor of the target "10x faster than our CPU step").

A step is read back on the host (pyml's loss is a host float; torch's `loss.item()`), so each
step's time includes its device work. Every system's first loss must agree with PyTorch eager's
within 1e-3 relative. Decoding: one sequence, a prompt of 16 tokens and 64 greedy tokens, tokens/s,
on the GPU (the float32 model's step, and the fused step on Q8_0 weights) and on the CPU (the
same two).

    python bench/gpu_step.py [--out DIR] [--spec smollm2_135m] [--batches 2x128,16x512]
           [--steps 10] [--warmup 2] [--torch-device cuda] [--prompt-tokens 16] [--new-tokens 64]
           [--decode-devices cuda,cpu]

Results go to DIR/gpu_step.{json,md} (default bench/results). On a machine without a GPU, run under
NUMBA_ENABLE_CUDASIM=1 with a tiny spec and --torch-device cpu to check the script itself (the
simulator's times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import tomllib
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LR, WEIGHT_DECAY, BETAS, EPS = 3e-4, 0.1, (0.9, 0.95), 1e-8
LOSS_AGREEMENT = 1e-3


def batches(vocab: int, b: int, t: int, count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    windows = rng.integers(0, vocab, (count, b, t + 1))
    return [(w[:, :-1].copy(), w[:, 1:].copy()) for w in windows]


def llama_config(spec: dict):
    """transformers' LlamaConfig of a Llama-form decoder spec (SmolLM2's shape)."""
    from transformers import LlamaConfig

    attention = spec["block"]["attention"]
    return LlamaConfig(
        vocab_size=spec["embedding"]["vocab_size"], hidden_size=spec["embedding"]["dim"],
        intermediate_size=spec["block"]["mlp"]["hidden"], num_hidden_layers=spec["block"]["count"],
        num_attention_heads=attention["n_heads"], num_key_value_heads=attention["n_kv_heads"],
        head_dim=attention["head_dim"], rope_theta=attention["rope"]["theta"],
        rms_norm_eps=spec["block"]["attn_norm"]["eps"], max_position_embeddings=spec["max_seq_len"],
        tie_word_embeddings=spec["lm_head"].get("tied", False), attention_bias=False, mlp_bias=False,
    )


class Pyml:
    def __init__(self, package, device: str, host_weights: np.ndarray, route: str | None = None):
        self.package, self.route = package, route
        self.name = f"pyml {device}" + (f", products: {route}" if route else "")
        self.select_route()
        self.model = package.Model(device=device)
        self.model.device.to_device(host_weights, self.model.params.flat)
        self.optimizer = package.AdamW(self.model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def select_route(self) -> None:
        if self.route:
            os.environ["PYML_CUDA_PRODUCTS"] = self.route

    def step(self, inputs, targets) -> float:
        self.select_route()
        loss = self.package.train_step(self.model, self.optimizer, inputs, targets)
        if self.model.device.name == "cuda":  # AdamW's kernels too, not only those the loss waited for
            self.model.device.cuda.synchronize()
        return loss


class TorchEager:
    def __init__(self, spec: dict, weights_file: Path, device: str):
        import torch
        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        self.torch, self.device = torch, device
        self.name = f"PyTorch eager {device}"
        model = LlamaForCausalLM(llama_config(spec))
        missing, unexpected = model.load_state_dict(load_file(weights_file), strict=False)
        # the tied head is the embedding: transformers lists lm_head.weight as missing and ties it
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        model.tie_weights()
        model.config._attn_implementation = "sdpa"
        self.model = model.to(device=device, dtype=torch.float32).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                           weight_decay=WEIGHT_DECAY)

    def step(self, inputs, targets) -> float:
        torch = self.torch
        self.optimizer.zero_grad(set_to_none=True)
        ids = torch.from_numpy(inputs).to(self.device)
        logits = self.model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(targets).to(self.device).reshape(-1))
        loss.backward()
        self.optimizer.step()
        return loss.item()


def timed_steps(system, data, warmup: int) -> dict:
    losses, seconds = [], []
    for index, (inputs, targets) in enumerate(data):
        started = time.perf_counter()
        losses.append(system.step(inputs, targets))
        if index >= warmup:
            seconds.append(time.perf_counter() - started)
    return {"losses": losses, "seconds": seconds, "median_s": statistics.median(seconds),
            "min_s": min(seconds), "max_s": max(seconds)}


def decode_rate(decoder, vocab: int, prompt_tokens: int, new_tokens: int, seed: int) -> dict:
    """Tokens/s of greedy decoding of one sequence, the prompt's prefill and the first token's
    step (which compiles the step's kernels) left out."""
    prompt = np.random.default_rng(seed).integers(0, vocab, (1, prompt_tokens))
    cache, logits = decoder.start_decoding(prompt, prompt_tokens + new_tokens)
    tokens = [int(np.argmax(logits[0]))]
    logits = decoder.decode(cache, np.array(tokens[-1:]))
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        tokens.append(int(np.argmax(logits[0])))
        logits = decoder.decode(cache, np.array(tokens[-1:]))
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": (new_tokens - 1) / elapsed, "tokens": tokens}


def device_description(torch_device: str) -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    described = {"machine": platform.machine(), "processor": names[0] if names else platform.processor(),
                 "cpu_count": os.cpu_count(), "python": platform.python_version()}
    import numba

    described["numba"] = numba.__version__
    try:
        import torch

        described["torch"] = torch.__version__
        if torch_device == "cuda":
            described["gpu"] = torch.cuda.get_device_name(0)
            described["torch_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
            described["torch_tf32_cudnn"] = torch.backends.cudnn.allow_tf32
            described["torch_float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except ImportError:
        pass
    try:
        import cupy

        described["cupy"] = cupy.__version__
        described["cupy_tf32"] = os.environ.get("CUPY_TF32", "0")
    except ImportError:
        pass
    return described


def cupy_importable() -> bool:
    from numba import config

    if config.ENABLE_CUDASIM:
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def markdown(report: dict) -> str:
    described = report["device"]
    lines = [f"pyml's CUDA path, {report['spec']} (random weights, float32), {report['date']}, "
             f"{described.get('gpu', 'no GPU (simulator)')}; CPU {described['processor'] or described['machine']}, "
             f"{described['cpu_count']} cores; {json.dumps({k: v for k, v in described.items() if k not in ('gpu', 'processor', 'machine', 'cpu_count')})}.",
             "", "| batch | system | median s/step | min | max | vs PyTorch eager | first loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for batch, systems in report["steps"].items():
        eager = next((row["median_s"] for name, row in systems.items() if name.startswith("PyTorch")), None)
        for name, row in systems.items():
            ratio = f"{row['median_s'] / eager:.2f}" if eager else ""
            lines.append(f"| {batch} | {name} | {row['median_s']:.4f} | {row['min_s']:.4f} | "
                         f"{row['max_s']:.4f} | {ratio} | {row['losses'][0]:.5f} |")
    lines += ["", f"| decoding (1 sequence, {report['new_tokens']} tokens after {report['prompt_tokens']}) | tokens/s |",
              "| --- | --- |"]
    lines += [f"| {name} | {row['tokens_per_s']:.1f} |" for name, row in report["decode"].items()]
    lines += ["", f"Largest relative difference of a first loss to PyTorch eager's: "
              f"{report['loss_agreement']:.2e} (at most {LOSS_AGREEMENT:.0e})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--spec", default="smollm2_135m")
    parser.add_argument("--batches", default="2x128,16x512")
    parser.add_argument("--cpu-batches", default="2x128", help="the batches pyml's CPU step runs too")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a system and batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-device", default="cuda")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-devices", default="cuda,cpu")
    args = parser.parse_args()

    import pyml

    spec_path = ROOT / "specs" / f"{args.spec}.toml"
    spec = tomllib.loads(spec_path.read_text())
    package = pyml.compile(spec_path)
    vocab = spec["embedding"]["vocab_size"]
    weights = package.Model.initialized(seed=0).params.flat.copy()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory()
    weights_file = Path(scratch.name) / "random.safetensors"  # what PyTorch loads
    host_model = package.Model()
    host_model.params.flat[:] = weights
    host_model.to_safetensors(weights_file)

    routes = ["kernels", "cublas"] if cupy_importable() else ["kernels"]
    report = {"spec": args.spec, "date": date.today().isoformat(), "device": device_description(args.torch_device),
              "routes": routes, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "steps": {}, "decode": {}}
    worst = 0.0
    for batch in args.batches.split(","):
        b, t = (int(n) for n in batch.split("x"))
        data = batches(vocab, b, t, args.warmup + args.steps, seed=b * 1000 + t)
        makers = [lambda: TorchEager(spec, weights_file, args.torch_device),
                  *(lambda route=route: Pyml(package, "cuda", weights, route) for route in routes)]
        if batch in args.cpu_batches.split(","):
            makers.append(lambda: Pyml(package, "cpu", weights))
        rows = {}
        for make in makers:  # one at a time, each freed before the next is made
            system = make()
            rows[system.name] = timed_steps(system, data, args.warmup)
            print(f"{batch} {system.name}: {rows[system.name]['median_s']:.4f} s/step, "
                  f"first loss {rows[system.name]['losses'][0]:.5f}", flush=True)
            del system
        eager_loss = rows[f"PyTorch eager {args.torch_device}"]["losses"][0]
        worst = max(worst, *(abs(row["losses"][0] - eager_loss) / abs(eager_loss) for row in rows.values()))
        report["steps"][batch] = rows
    report["loss_agreement"] = worst

    from pyml.generate.quantized import QuantizedDecoder

    for device in args.decode_devices.split(","):
        model = package.Model(device=device)
        model.device.to_device(weights, model.params.flat)
        lengths = dict(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, seed=1)
        report["decode"][f"pyml {device}, float32 weights"] = decode_rate(model, vocab, **lengths)
        # last: on CUDA the fused step puts the weights' dequantization in the model's place
        fused = QuantizedDecoder.of_model(model, "q8_0")
        report["decode"][f"pyml {device}, Q8_0 weights"] = decode_rate(fused, vocab, **lengths)
        print(device, {name: round(row["tokens_per_s"], 1) for name, row in report["decode"].items()}, flush=True)

    stem = args.out / "gpu_step"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    if worst > LOSS_AGREEMENT:
        raise SystemExit(f"a first loss differs from PyTorch eager's by {worst:.2e}, more than {LOSS_AGREEMENT:.0e}")


if __name__ == "__main__":
    main()
