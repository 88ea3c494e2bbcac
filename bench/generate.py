"""Generation speed: `pyml generate`'s path against Hugging Face transformers' `generate`.

Same weights (the shipped SmolLM2-135M-Instruct GGUF; transformers loads it itself), the same chat
prompt, greedy decoding with a KV cache on both sides, and the same new tokens (checked). Prefill
tokens/s is the prompt length over the time to the first logits; decode tokens/s counts the tokens
after the first. Each system runs once to warm up, then `--repeats` times; medians are reported.

    python bench/generate.py [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours_run(model, ids, new_tokens, stop):
    started = time.perf_counter()
    cache, logits = model.start_decoding(np.array([ids]), len(ids) + new_tokens)
    prefill = time.perf_counter() - started
    out = [int(np.argmax(logits[0]))]
    started = time.perf_counter()
    while len(out) < new_tokens and out[-1] not in stop:
        out.append(int(np.argmax(model.decode(cache, np.array([out[-1]]))[0])))
    return out, prefill, time.perf_counter() - started


def transformers_run(model, ids, new_tokens):
    import torch

    prompt = torch.tensor([ids])
    with torch.no_grad():
        started = time.perf_counter()
        first = model(prompt, use_cache=True)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        generated = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                   attention_mask=torch.ones_like(prompt))
        total = time.perf_counter() - started
    out = generated[0, len(ids):].tolist()
    assert out[0] == int(first.logits[0, -1].argmax())
    # generate() includes its own prefill; the decode time is what remains after one
    return out, prefill, max(total - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from train_step import ensure_model  # run as a script, bench/ is on sys.path
    from pyml.runtime import generate as generation
    from pyml.runtime.smollm2_gguf import shipped_gguf_path

    model_dir = ensure_model()
    ours = generation.load_model(model_dir, ROOT / "specs" / "smollm2_135m.toml")
    tokenizer = generation.load_tokenizer(model_dir)
    ids = generation.prompt_ids(model_dir, tokenizer, PROMPT, chat=True)
    stop = generation.eos_ids(model_dir)
    gguf = shipped_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()

    results = {"ours": [], "transformers": []}
    outputs = {}
    for repeat in range(args.repeats + 1):  # the first run of each warms up
        for name in results:
            if name == "ours":
                out, prefill, decode = ours_run(ours, ids, args.new_tokens, stop)
            else:
                out, prefill, decode = transformers_run(theirs, ids, args.new_tokens)
            outputs[name] = out
            if repeat:
                results[name].append((len(ids) / prefill, (len(out) - 1) / decode))
    same = outputs["ours"] == outputs["transformers"][: len(outputs["ours"])]
    report = {
        "date": date.today().isoformat(), "prompt_tokens": len(ids), "new_tokens": len(outputs["ours"]),
        "outputs_identical": same,
        "systems": {name: {"prefill_tokens_per_s": statistics.median(r[0] for r in runs),
                           "decode_tokens_per_s": statistics.median(r[1] for r in runs)}
                    for name, runs in results.items()},
    }
    lines = [f"SmolLM2-135M-Instruct generation, greedy with a KV cache, {report['date']}: "
             f"{len(ids)} prompt tokens, {report['new_tokens']} new tokens, outputs identical: {same}.",
             "", "| system | prefill tokens/s | decode tokens/s |", "| --- | --- | --- |"]
    for name, result in report["systems"].items():
        lines.append(f"| {name} | {result['prefill_tokens_per_s']:.1f} | {result['decode_tokens_per_s']:.1f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "generate.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
