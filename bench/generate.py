"""Generation speed: `pyml generate`'s path against Hugging Face transformers and llama.cpp.

Same weights (the shipped GGUF of `--model`, SmolLM2-135M-Instruct by default or Gemma 3 270M:
pyml imports it, llama.cpp loads it itself, and transformers loads SmolLM2's GGUF itself and Gemma's
from the imported folder, which holds the weights its GGUF loader gives bit for bit in a fraction of
the minutes that loader takes), the same prompt as token ids (in the chat template where the model
has one; Gemma 3 270M is a base model), greedy decoding with a KV cache, the same
number of new tokens (at most; a system stops at an end-of-sequence token). Prefill tokens/s is the
prompt length over the time to the first logits; decode tokens/s counts the tokens after the first.
Each system runs in a process of its own, started from the environment this script was started
with (pyml puts its thread-pool policy in force itself; PyTorch's OpenMP threads, spinning after
each of its calls, would otherwise starve pyml's kernels), once to warm up, then `--repeats` times;
medians are reported, with each process's peak resident memory. pyml runs three times: float32;
with `pyml generate`'s default `--weights as-stored`, the fused decode step on the GGUF's own
blocks (the row names their formats); and the same with `--activations q8_0`, the activations
rounded to int8 as llama.cpp rounds them. llama.cpp runs when
`llama-cpp-python` is importable (`make bench-llamacpp` installs it), twice (`llamacpp_model` says
why): with its defaults, the prompt one token at a time, and without its extra buffer types, the
prompt in one batch; on all cores, its KV cache cleared before every run so that its prefill is
measured. pyml's tokens, in its float32 and as-stored rows, must equal
transformers' (the benchmark fails otherwise); for the rows that round activations to int8 (pyml's
q8_0 and llama.cpp's) the table reports how many leading tokens equal transformers'.

    python bench/generate.py [--model smollm2|gemma3] [--new-tokens 64] [--repeats 3]

Results go to bench/results/generate.{json,md} (generate_gemma3.* for Gemma).
"""

from __future__ import annotations

import os

# Captured before anything imports pyml (which sets thread-pool variables on import): each system's
# process starts from the environment the user gave.
START_ENVIRONMENT = dict(os.environ)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SYSTEMS = {"ours": "pyml (float32, Numba CPU)",
           "ours_quantized": "pyml (fused decode step, weights as stored: {formats}; Numba CPU)",
           "ours_int8": "pyml (fused decode step, --activations q8_0: {formats}; Numba CPU)",
           "transformers": "transformers (PyTorch eager)",
           "llamacpp": "llama.cpp (llama-cpp-python defaults, the GGUF as shipped; prompt one token at a time)",
           "llamacpp_batched": "llama.cpp (llama-cpp-python, extra buffer types off; prompt in one batch)"}


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


def llamacpp_model(gguf: Path, n_ctx: int, n_batch: int, threads: int, extra_buffer_types: bool):
    """llama.cpp on the shipped GGUF, in two configurations, because on a development machine with
    AMX (2026-12-01, llama-cpp-python 0.3.36 built for its AVX-512 and AMX) its defaults crash on a
    batch of more than one token (a general protection fault in libggml-cpu's AMX product) but
    decode one token at a time at their full speed:
    - defaults (its extra buffer types: the weights repacked for AMX where the CPU has it; without
      AMX its repacking covers other formats than SmolLM2's Q4_1, so both rows decode alike), the
      prompt evaluated one token at a time: llama.cpp's fastest decode on an AMX machine;
    - extra buffer types off, the prompt in one batch: its batched prefill (AVX-512 VNNI dot
      products), and a slower decode where AMX was on.
    The report names the CPU and llama.cpp's backend, since the ratios depend on them."""
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    if extra_buffer_types:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                     n_threads_batch=threads, verbose=False)
    defaults = bindings.llama_model_default_params

    def without_extra_buffer_types():
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffer_types  # Llama() reads it
    try:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_batch,
                     n_threads=threads, n_threads_batch=threads, verbose=False)
    finally:
        bindings.llama_model_default_params = defaults


def llamacpp_run(model, ids, new_tokens, stop):
    def next_token():
        # the logits of the last token evaluated (the only ones computed: logits_all is off)
        return int(np.argmax(np.ctypeslib.as_array(model._ctx.get_logits(), shape=(model.n_vocab(),))))

    model.reset()
    model._ctx.kv_cache_clear()  # no prompt cache: the prompt is evaluated from scratch
    started = time.perf_counter()
    model.eval(ids)
    out = [next_token()]
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    while len(out) < new_tokens and out[-1] not in stop:
        model.eval([out[-1]])
        out.append(next_token())
    return out, prefill, time.perf_counter() - started


def thread_pools() -> list[str]:
    from threadpoolctl import threadpool_info

    return sorted({f"{pool['prefix']}:{pool['num_threads']}" for pool in threadpool_info()})


def run_system(system: str, model_name: str, new_tokens: int, repeats: int) -> dict:
    """Timings and tokens of one system, in this process."""
    from train_step import MODELS, ensure_model  # run as a script, bench/ is on sys.path

    from pyml.generate import decoding as generation

    bench_model = MODELS[model_name]
    model_dir = ensure_model(bench_model)
    tokenizer = generation.load_tokenizer(model_dir)
    chat = model_name == "smollm2"  # Gemma 3 270M has no chat template
    ids = generation.prompt_ids(model_dir, tokenizer, PROMPT, chat=chat)
    formats = backend = None
    if system in ("ours", "ours_quantized", "ours_int8"):
        spec = ROOT / "specs" / f"{bench_model.spec}.toml"
        if system == "ours":
            model = generation.load_model(model_dir, spec)
        else:  # pyml generate's default, --weights as-stored, with or without int8 activations
            activations = "q8_0" if system == "ours_int8" else "f32"
            model = generation.load_decoder(model_dir, spec, activations=activations)
            formats = model.describe_formats()
        stop = generation.eos_ids(model_dir)
        run = lambda: ours_run(model, ids, new_tokens, stop)  # noqa: E731
    elif system in ("llamacpp", "llamacpp_batched"):
        gguf = importlib.import_module(bench_model.shipped).shipped_gguf_path()
        batched = system == "llamacpp_batched"
        model = llamacpp_model(gguf, len(ids) + new_tokens, len(ids) if batched else 1,
                               os.cpu_count(), extra_buffer_types=not batched)
        stop = generation.eos_ids(model_dir)
        run = lambda: llamacpp_run(model, ids, new_tokens, stop)  # noqa: E731
        from llama_cpp.llama_cpp import llama_print_system_info

        backend = llama_print_system_info().decode().strip(" |")  # which of its kernels it built
    else:
        import torch
        from transformers import AutoModelForCausalLM

        if model_name == "smollm2":
            from pyml.formats.smollm2_gguf import shipped_gguf_path

            gguf = shipped_gguf_path()
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32).eval()
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        run = lambda: transformers_run(model, ids, new_tokens)  # noqa: E731
    runs = []
    for repeat in range(repeats + 1):  # the first run warms up
        out, prefill, decode = run()
        if repeat:
            runs.append((len(ids) / prefill, (len(out) - 1) / decode))
    return {"prompt_tokens": len(ids), "tokens": out,
            "prefill_tokens_per_s": statistics.median(r[0] for r in runs),
            "decode_tokens_per_s": statistics.median(r[1] for r in runs),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "thread_pools": thread_pools(), "formats": formats, "backend": backend}


def leading_agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of `tokens` equal `reference`'s."""
    count = 0
    for token, expected in zip(tokens, reference):
        if token != expected:
            break
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        print(json.dumps(run_system(args.system, args.model, args.new_tokens, args.repeats)))
        return

    systems = ["ours", "ours_quantized", "ours_int8", "transformers"]
    if importlib.util.find_spec("llama_cpp"):
        systems += ["llamacpp", "llamacpp_batched"]
    results = {}
    for system in systems:
        child = subprocess.run([sys.executable, __file__, "--system", system, "--model", args.model,
                                "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)],
                               env=START_ENVIRONMENT, capture_output=True, text=True)
        if child.returncode != 0:
            last_line = (child.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: the {system} run failed: {last_line}")
        results[system] = json.loads(child.stdout.strip().splitlines()[-1])
    reference = results["transformers"]["tokens"]
    same = all(results[name]["tokens"] == reference[: len(results[name]["tokens"])]
               for name in ("ours", "ours_quantized"))
    from train_step import machine_description

    report = {
        "model": args.model, "date": date.today().isoformat(), "machine": machine_description(),
        "prompt_tokens": results["ours"]["prompt_tokens"], "new_tokens": len(results["ours"]["tokens"]), "outputs_identical": same,
        "systems": {name: {"name": SYSTEMS[name].format(formats=result["formats"]),
                           "leading_tokens_equal_to_transformers": leading_agreement(result["tokens"], reference),
                           **{key: result[key] for key in ("prefill_tokens_per_s", "decode_tokens_per_s",
                                                           "peak_rss_mib", "thread_pools", "tokens", "backend")}}
                    for name, result in results.items()},
    }
    title = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}[args.model]
    lines = [f"{title} generation, greedy with a KV cache, {report['date']}: "
             f"{report['machine']}; {report['prompt_tokens']} prompt tokens, {report['new_tokens']} new tokens, "
             f"pyml's tokens (float32 and as-stored rows) identical to transformers': {same}.",
             "", "| system | prefill tokens/s | decode tokens/s | peak RSS MiB | leading tokens equal to transformers' |",
             "| --- | --- | --- | --- | --- |"]
    for result in report["systems"].values():
        lines.append(f"| {result['name']} | {result['prefill_tokens_per_s']:.1f} | "
                     f"{result['decode_tokens_per_s']:.1f} | {result['peak_rss_mib']:.0f} | "
                     f"{result['leading_tokens_equal_to_transformers']} of {len(result['tokens'])} |")
    lines += [""] + [f"Thread pools, {result['name']}: {result['thread_pools']}."
                     for result in report["systems"].values()]
    if "llamacpp" in results:
        lines += ["", f"llama.cpp's CPU backend (llama_print_system_info): {results['llamacpp']['backend']}."]
    if "llamacpp" not in results:
        lines += ["", "llama.cpp not run: `make bench-llamacpp` installs llama-cpp-python."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "generate" if args.model == "smollm2" else f"generate_{args.model}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not same:
        # a speed figure is only worth something if both systems produced the same text
        raise SystemExit("error: pyml's greedy tokens (float32 or quantized) differ from transformers'")


if __name__ == "__main__":
    main()
