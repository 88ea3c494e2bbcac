"""LoRA over a quantized base (QLoRA, issue 42) at the scale people fine-tune: pyml's training step on
the GGUF's own rows against peft + transformers on the dequantized float32 model, on the same
weights, the same threads, each system in a process of its own, back to back.

The GGUFs are bench/scale.py's synthetic ones (`--shape qwen2.5-1.5b --type q8_0`, the default, or
`--shape llama3.1-8b --type q4_0`), cached in `--work` and imported there by `pyml import-gguf`, or
an imported folder given as `--folder` (the shipped SmolLM2 or Gemma 3).
Every system trains LoRA adapters of rank 16 (alpha 32) on q, k, v, o, gate, up and down, one row of
512 tokens a step (random token ids, seeded; the same for every system), AdamW (lr 2e-4):
- `pyml_qlora`: pyml's LoRA model over the folder as stored (`pyml train --init FOLDER --lora-rank
  16`: the linear maps read from the GGUF's memory map, a tile of rows at a time), with `--recompute`
  (each block's input kept, the block recomputed in the backward);
- `pyml_qlora_no_recompute`: the same without recompute (every layer's activations kept);
- `pyml_f32_base`: pyml's LoRA model over a float32 copy of the base (what `pyml train --lora-rank`
  built before this issue);
- `peft`: transformers' model of the dequantized base in float32 (written once as model.safetensors
  beside the folder's config and tokenizer) with peft's LoRA, torch.optim.AdamW, torch's threads set
  to `--threads`; no gradient checkpointing (transformers' default);
- `pyml_qlora_bf16`, `peft_bf16` (issue 45): `pyml_qlora_no_recompute` with `--precision bf16` (the
  frozen maps' products in bf16, each tile of dequantized rows rounded as it is packed), and `peft`
  under `torch.autocast("cpu", dtype=torch.bfloat16)`.
The float32 systems need 4 bytes a parameter: they are left out where that exceeds the machine's
memory (the 8B shape). Each process runs `--steps` steps; the first (compilation, page faults) is
not counted: step time is the median of the others. Peak resident memory is ru_maxrss from
os.wait4 (memory-mapped file pages included).

    python bench/qlora.py [--shape qwen2.5-1.5b|llama3.1-8b|tiny] [--type q8_0|q4_0] [--folder DIR]
                          [--systems pyml_qlora,...] [--threads 2] [--steps 3] [--work DIR]

Results go to bench/results/qlora_<shape>_<type>.{json,md}, or qlora_<folder name>.*.
"""

from __future__ import annotations

import os

START_ENVIRONMENT = dict(os.environ)  # before pyml's import sets thread-pool variables

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import GIB, SHAPES, import_gguf, run_measured, synthetic_gguf, thread_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
RANK, ALPHA, LR, SEQ = 16, 32.0, 2e-4, 512
SYSTEMS = {
    "pyml_qlora": "pyml, base as stored, --recompute",
    "pyml_qlora_no_recompute": "pyml, base as stored",
    "pyml_f32_base": "pyml, float32 copy of the base",
    "peft": "peft + transformers, float32",
    "pyml_qlora_bf16": "pyml, base as stored, --precision bf16",
    "peft_bf16": "peft + transformers, float32, CPU autocast bf16",
}
FLOAT32_SYSTEMS = ("pyml_f32_base", "peft", "peft_bf16")


def batch(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def pyml_steps(system: str, folder: Path, steps: int) -> list[float]:
    from pyml.formats.stored_tensors import stored_weights
    from pyml.packages import spec_file
    from pyml.train.lora import lora_settings, lora_spec

    spec, package = lora_spec(spec_file(folder), lora_settings(RANK, ALPHA, TARGETS))
    if system == "pyml_f32_base":
        model = package.Model(np.float32)  # the maps in a float32 buffer
        base, source = stored_weights(folder)
        adapters = package.Model.tensors(package.Parameters(np.zeros(package.Parameters.SIZE, np.float32)))
        model.load_tensors(adapters | base, source)  # zero adapters: the step's time is the same
        del base
    else:
        model = package.Model.from_base(folder, seed=0)
    model.recompute = system == "pyml_qlora"
    if system == "pyml_qlora_bf16":
        model.set_precision("bf16")
    optimizer = package.AdamW(model, lr=LR)
    ids, targets = batch(spec.embedding.vocab_size)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        package.train_step(model, optimizer, ids, targets)
        seconds.append(time.perf_counter() - started)
    return seconds


def peft_steps(loadable: Path, vocab: int, threads: int, steps: int, autocast: bool = False) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pyml.train.lora import PEFT_MODULES

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(loadable, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                                             target_modules=[PEFT_MODULES[t] for t in TARGETS]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ids, targets = (torch.tensor(a) for a in batch(vocab))
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    return seconds


def transformers_copy(folder: Path) -> Path:
    """The imported folder as transformers loads it: its files beside a float32 model.safetensors
    of the dequantized weights (written once, in a process of its own)."""
    loadable = folder.with_name(folder.name + ".transformers")
    if (loadable / "model.safetensors").is_file():
        return loadable
    code = ("import sys; from pathlib import Path; from pyml.formats.stored_tensors import StoredFolder; "
            "from pyml.formats.safetensors_io import write_safetensors; "
            "f, out = Path(sys.argv[1]), Path(sys.argv[2]); out.mkdir(exist_ok=True); "
            "[(out / p.name).write_bytes(p.read_bytes()) for p in f.iterdir() if p.name != 'source.gguf']; "
            "write_safetensors(out / 'model.safetensors', StoredFolder(f).dense_tensors(), metadata={'format': 'pt'})")
    run_measured([sys.executable, "-c", code, str(folder), str(loadable)], dict(START_ENVIRONMENT))
    return loadable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--type", choices=["q8_0", "q4_0"], default="q8_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pyml-bench-scale")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"which to run, comma-separated (default all: {', '.join(SYSTEMS)})")
    parser.add_argument("--folder", type=Path, help="an imported model folder to train over instead of "
                        "a synthetic shape (the shipped SmolLM2 or Gemma 3: `make demo` imports SmolLM2)")
    for internal in ("--system", "--loadable", "--vocab"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        if args.system in ("peft", "peft_bf16"):
            seconds = peft_steps(Path(args.loadable), int(args.vocab), args.threads, args.steps,
                                 autocast=args.system == "peft_bf16")
        else:
            seconds = pyml_steps(args.system, Path(args.folder), args.steps)
        print(json.dumps(seconds))
        return
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2 (the first step is not counted)")

    from pyml.formats.stored_tensors import StoredFolder

    if args.folder is not None:
        folder = args.folder.resolve()
        gguf_path, name = (folder / "source.gguf").resolve(), folder.name
    else:
        gguf_path = synthetic_gguf(args.work, args.shape, args.type, args.seed)
        folder, name = args.work / f"{gguf_path.stem}-imported", f"{args.shape}_{args.type}"
        if not (folder / "spec.toml").is_file():
            import_gguf(gguf_path, folder, args.threads)
    stored = StoredFolder(folder)
    vocab = stored.tensors["model.embed_tokens.weight"].shape[0]
    parameters = sum(int(np.prod(t.shape)) for t in stored.tensors.values())
    fits = 4 * parameters < 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    asked = args.systems.split(",")
    if set(asked) - set(SYSTEMS):
        sys.exit(f"error: --systems takes {', '.join(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s in asked and (fits or s not in FLOAT32_SYSTEMS)]
    loadable = transformers_copy(folder) if {"peft", "peft_bf16"} & set(systems) else None
    results = {}
    for system in systems:
        command = [sys.executable, __file__, "--system", system, "--folder", str(folder),
                   "--loadable", str(loadable), "--vocab", str(vocab), "--threads", str(args.threads),
                   "--steps", str(args.steps)]
        out, wall, peak = run_measured(command, thread_environment(args.threads))
        seconds = json.loads(out.strip().splitlines()[-1])
        step = statistics.median(seconds[1:])
        results[system] = {"peak_rss_gib": peak, "step_seconds": seconds, "median_step_s": step,
                           "tokens_per_s": SEQ / step, "process_wall_s": wall}
        print(system, json.dumps(results[system]), flush=True)

    from train_step import machine_description

    report = {"model": name, "file": gguf_path.name, "formats": stored.describe(),
              "gguf_gib": gguf_path.stat().st_size / GIB, "parameters": int(parameters),
              "date": date.today().isoformat(), "machine": machine_description(),
              "threads": args.threads, "steps": args.steps, "rank": RANK, "seq": SEQ,
              "results": results}
    left_out = [SYSTEMS[s] for s in SYSTEMS if s in asked and s not in systems]
    lines = [
        f"QLoRA: {name} ({gguf_path.name}: {stored.describe()}, "
        f"{parameters / 1e9:.2f}B parameters), {report['date']}: {report['machine']}; {args.threads} threads; "
        f"LoRA rank {RANK} on q, k, v, o, gate, up, down; 1 x {SEQ} tokens a step, AdamW; "
        f"median of {args.steps - 1} steps after the first; peak RSS: ru_maxrss from os.wait4.",
        "",
        "| system | peak RSS, GiB | step, s | tokens/s |",
        "| --- | --- | --- | --- |",
    ] + [f"| {SYSTEMS[s]} | {r['peak_rss_gib']:.2f} | {r['median_step_s']:.1f} | {r['tokens_per_s']:.1f} |"
         for s, r in results.items()]
    if left_out:
        lines += ["", f"Not run (float32 weights need {4 * parameters / GIB:.1f} GiB, more than this machine "
                  f"holds): {'; '.join(left_out)}."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"qlora_{name}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
