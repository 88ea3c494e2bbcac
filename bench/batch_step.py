"""The fused decode step on a batch: milliseconds per step and tokens/s at 1, 4, 8 and 16
sequences, on SmolLM2's GGUF weights as stored, with float32 activations and with
`--activations q8_0`; the step `pyml serve` runs, without the server around it. Near position 64,
where the weights' reads and products are most of a step, and at 1 and 8 sequences near position
1024, where attention's reads of the keys and values are. And its prefill:
a 256-token prompt through the step, 32 tokens per call (what `pyml generate` and `pyml serve` do
on the CPU), against the float32 model's matrix-matrix forward (what they did before).

Each batch size runs in a DecodingBatch of that many sequences at position 64 or so (or 1024; their
prompts prefilled first), one token each per step, `--warmup` steps, then `--steps` timed; the median
step is reported. A prefill is timed `--repeats` times after one to warm up; the median is
reported.

    python bench/batch_step.py [--model DIR] [--steps 30] [--warmup 5] [--repeats 5]

Results go to bench/results/batch_step.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import numpy as np

from pyml.generate import decoding
from pyml.generate.quantized import DecodingBatch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BATCHES = (1, 4, 8, 16)
LONG_CONTEXT_BATCHES = (1, 8)
PROMPT = list(range(1000, 1064))  # 64 ids of SmolLM2's vocabulary
LONG_PROMPT = list(range(1000, 1256))
LONG_CONTEXT = [1000 + index % 500 for index in range(1024)]


def step_seconds(decoder, sequences: int, steps: int, warmup: int, prompt: list[int] = PROMPT) -> float:
    batch = DecodingBatch(decoder, sequences, len(prompt) + warmup + steps, chunk=256)
    rows = [batch.add(prompt) for _ in range(sequences)]
    while len(batch.prompts):
        batch.step({})
    times = []
    for index in range(warmup + steps):
        started = time.perf_counter()
        batch.step({row: 1000 + index for row in rows})
        times.append(time.perf_counter() - started)
    return statistics.median(times[warmup:])


def prefill_seconds(decoder, repeats: int) -> float:
    """The median time of `decoder.start_decoding` (a model's or a QuantizedDecoder's) on LONG_PROMPT."""
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        decoder.start_decoding(np.array([LONG_PROMPT]), len(LONG_PROMPT) + 1)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results, long_context, prefill = {}, {}, {}
    for activations in ("f32", "q8_0"):
        decoder = decoding.load_decoder(args.model, activations=activations)
        if activations == "f32":
            prefill["float32 forward"] = prefill_seconds(decoding.load_model(args.model), args.repeats)
        prefill[f"the step, {activations} activations"] = prefill_seconds(decoder, args.repeats)
        print("prefill", json.dumps(prefill), flush=True)
        results[activations] = []
        for sequences in BATCHES:
            seconds = step_seconds(decoder, sequences, args.steps, args.warmup)
            results[activations].append({"sequences": sequences, "ms_per_step": round(1000 * seconds, 2),
                                         "tokens_per_s": round(sequences / seconds, 1)})
            print(activations, json.dumps(results[activations][-1]), flush=True)
        long_context[activations] = []
        for sequences in LONG_CONTEXT_BATCHES:
            seconds = step_seconds(decoder, sequences, args.steps, args.warmup, LONG_CONTEXT)
            long_context[activations].append({"sequences": sequences, "ms_per_step": round(1000 * seconds, 2),
                                              "tokens_per_s": round(sequences / seconds, 1)})
            print(activations, "long context", json.dumps(long_context[activations][-1]), flush=True)
    report = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "model": args.model.name, "results": results,
              "near_position_1024": long_context,
              "prefill_256_tokens_per_s": {name: round(len(LONG_PROMPT) / seconds, 1)
                                           for name, seconds in prefill.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch_step.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"The fused decode step on {report['model']} (the GGUF's weights as stored), {report['date']}, "
             f"{report['machine']}: ms per step, tokens/s (x its 1-sequence figure); the median of "
             f"{args.steps} steps."]
    for title, table in (("near position 64", results), ("near position 1024", long_context)):
        lines += ["", f"| sequences, {title} | float32 activations | --activations q8_0 |", "|---|---|---|"]
        for index, entry in enumerate(table["f32"]):
            cells = [f"{rows[index]['ms_per_step']} ms, {rows[index]['tokens_per_s']} tok/s "
                     f"({rows[index]['tokens_per_s'] / rows[0]['tokens_per_s']:.1f}x)" for rows in table.values()]
            lines.append(f"| {entry['sequences']} | " + " | ".join(cells) + " |")
    lines += ["", f"Prefill of a {len(LONG_PROMPT)}-token prompt, tokens/s: " + ", ".join(
        f"{name} {rate}" for name, rate in report["prefill_256_tokens_per_s"].items()) + "."]
    (RESULTS / "batch_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
