"""pyml at the scale people use (issue 41): a 1.5B-shaped model (or an 8B one) against llama.cpp,
on the same GGUF, the same threads, back to back, each measured in a process of its own.

The GGUF is synthetic, written here with gguf-py: `--shape qwen2.5-1.5b` (the default) is a qwen2
file of Qwen2.5-1.5B's block shape (hidden 1536, 28 layers, 12 query heads and 2 key/value heads of
128, FFN 8960, biases on q, k and v, the embedding tied to the head), `--shape llama3.1-8b` a llama
file of Llama-3.1-8B's (hidden 4096, 32 layers, 32/8 heads of 128, FFN 14336, its own head; its RoPE
scaling left out, which changes neither memory nor speed), `--shape tiny` a 2-layer one for smoke
runs. Every shape has SmolLM2's 49,152-token vocabulary, tokenizer and chat template (its
`tokenizer.*` keys copied from the shipped SmolLM2 GGUF), random weights (normal, std 0.02,
seeded; norm gains 1), every matrix stored in `--type` (q8_0 or q4_0, as gguf-py quantizes them;
norms and biases float32, as llama.cpp's converter stores them). The file is written tensor by
tensor (its float32 values a few rows at a time), cached in `--work` under a name that holds its
parameters, and reused.

Measured, each in a fresh process (`--threads` threads for every system: NUMBA_NUM_THREADS,
OMP_NUM_THREADS and OPENBLAS_NUM_THREADS for pyml, n_threads and n_threads_batch for llama.cpp):
- `pyml import-gguf FILE --out DIR`: wall time, peak resident memory, the size of the folder;
- generation on that folder with `pyml generate`'s defaults (`--weights as-stored`, `--activations
  f32`: the fused decode step on the GGUF's own rows), and again with `--activations q8_0` (the
  activations rounded to int8 as llama.cpp's CPU products round them): the child calls what `pyml
  generate` calls (load_tokenizer, load_decoder), because the CLI takes text and the prompts here
  are token ids;
- llama.cpp (llama-cpp-python) on the GGUF itself, with its defaults, the prompt in one batch;
- serving: `pyml serve --max-sequences 8` on the folder, and llama.cpp's `llama-server -np 8` on the
  GGUF where `--llama-server` names one (`make bench-serve` builds it), each with 2048 positions per
  sequence, answering 8 concurrent streamed chat requests of up to `--new-tokens` tokens once it is
  healthy: its peak resident memory.
For each generating system: peak resident memory; prefill tokens/s at 64 and at 512 prompt tokens
(the prompt over the time to its logits, the cache cleared before each); decode tokens/s (greedy,
`--new-tokens` after the 64-token prompt, end-of-sequence ignored so both decode as many); and the
time to the first token of a cold process: from the parent's spawn of the process (Python's start,
imports and model load included) to the greedy token after the 64-token prompt. Each system first
runs once unmeasured, so pyml's generated package is compiled and in the cache and the file is in
the page cache for both: "cold" is a fresh process, not a fresh machine. After the cold token, each
figure is the median of `--repeats` runs in that process.
Peak resident memory is ru_maxrss of the child, which `os.wait4` returns for it (the kernel's
high-water mark of its resident pages, memory-mapped file pages included).
The prompts are the first 64 and 512 token ids of CPython's reference documentation (the
`pydoc_data` topics, sorted by name), as the imported folder's tokenizer encodes it; the same ids go
to both systems.

    python bench/scale.py [--shape qwen2.5-1.5b|llama3.1-8b|tiny] [--type q8_0|q4_0] [--threads 2]
                          [--new-tokens 32] [--repeats 3] [--work DIR] [--llama-server PATH]

Results go to bench/results/scale.{json,md} for the default shape and type, and to
scale_<shape>_<type>.* for the others.
"""

from __future__ import annotations

import os

# Captured before anything imports pyml (which sets thread-pool variables on import): each system's
# process starts from the environment the user gave.
START_ENVIRONMENT = dict(os.environ)

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPT_LENGTHS = (64, 512)
WEIGHT_STD = 0.02
ROWS_PER_CHUNK = 2048  # rows generated and quantized at a time: the writer's memory stays small
GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """A model's block shape and the hyper-parameters its GGUF states."""

    architecture: str  # general.architecture: qwen2 has biases on q, k and v, llama none
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool  # the head is the token embedding (no output.weight)
    context_length: int
    rope_theta: float
    rms_eps: float


SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, True, 32768, 1e6, 1e-6),
    "llama3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, False, 131072, 5e5, 1e-5),
    "tiny": Shape("qwen2", 256, 2, 4, 2, 64, 512, True, 32768, 1e6, 1e-6),
}
DEFAULT_SHAPE, DEFAULT_TYPE = "qwen2.5-1.5b", "q8_0"
SYSTEMS = {
    "pyml": "pyml (--weights as-stored, --activations f32: pyml generate's defaults)",
    "pyml_q8_0": "pyml (--weights as-stored, --activations q8_0)",
    "llamacpp": "llama.cpp (llama-cpp-python defaults, the prompt in one batch)",
}
SERVE_SEQUENCES, SERVE_CONTEXT = 8, 2048  # pyml serve's default batch and its default context cap


# -- the synthetic GGUF


def tensor_shapes(shape: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the file (GGUF name) and its shape, rows first, as llama.cpp's converter
    writes a model of `shape`."""
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    shapes = {"token_embd.weight": (vocab, shape.hidden), "output_norm.weight": (shape.hidden,)}
    if not shape.tied:
        shapes["output.weight"] = (vocab, shape.hidden)
    block = {
        "attn_norm.weight": (shape.hidden,),
        "attn_q.weight": (q_rows, shape.hidden),
        "attn_k.weight": (kv_rows, shape.hidden),
        "attn_v.weight": (kv_rows, shape.hidden),
        "attn_output.weight": (shape.hidden, q_rows),
        "ffn_norm.weight": (shape.hidden,),
        "ffn_gate.weight": (shape.ffn, shape.hidden),
        "ffn_up.weight": (shape.ffn, shape.hidden),
        "ffn_down.weight": (shape.hidden, shape.ffn),
    }
    if shape.architecture == "qwen2":
        block |= {"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)}
    for layer in range(shape.layers):
        shapes |= {f"blk.{layer}.{name}": dims for name, dims in block.items()}
    return shapes


def random_tensor(name: str, dims: tuple[int, ...], quant_type, rng: np.random.Generator) -> np.ndarray:
    """A vector in float32 (a norm's gain 1, a bias small), or a matrix's rows quantized, generated
    ROWS_PER_CHUNK rows at a time so that no float32 copy of a large matrix is ever whole."""
    import gguf
    from gguf.quants import quantize

    if len(dims) == 1:
        if name.endswith("norm.weight"):
            return np.ones(dims, np.float32)
        return rng.standard_normal(dims, dtype=np.float32) * np.float32(WEIGHT_STD)
    rows, columns = dims
    stored = np.empty(gguf.quant_shape_to_byte_shape(dims, quant_type), np.uint8)
    for start in range(0, rows, ROWS_PER_CHUNK):
        chunk = rng.standard_normal((min(ROWS_PER_CHUNK, rows - start), columns), dtype=np.float32)
        chunk *= np.float32(WEIGHT_STD)
        stored[start:start + len(chunk)] = quantize(chunk, quant_type)
    return stored


def write_synthetic_gguf(path: Path, shape: Shape, type_name: str, seed: int) -> None:
    """The GGUF of `shape`, its matrices in `type_name`, written tensor by tensor: the tensor
    infos first, then each tensor's data as it is made."""
    import gguf

    from pyml.formats.smollm2_gguf import shipped_gguf_path

    quant_type = gguf.GGMLQuantizationType[type_name.upper()]
    smollm2 = gguf.GGUFReader(shipped_gguf_path())
    tokenizer_keys = {key: field for key, field in smollm2.fields.items() if key.startswith("tokenizer.")}
    vocab = len(tokenizer_keys["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(path, shape.architecture)
    writer.add_name(f"synthetic {path.stem}")
    writer.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[type_name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    for key, field in tokenizer_keys.items():
        value_type = field.types[0]
        element_type = field.types[1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, element_type)

    shapes = tensor_shapes(shape, vocab)
    for name, dims in shapes.items():
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(dims, quant_type)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in shapes.items():  # in the order of the infos, as write_tensor_data expects
        writer.write_tensor_data(random_tensor(name, dims, quant_type, rng))
    writer.close()


def synthetic_gguf(work: Path, shape_name: str, type_name: str, seed: int) -> Path:
    """The cached GGUF of these parameters, written first if `work` has none."""
    path = work / f"{shape_name}-{type_name}-seed{seed}-std{WEIGHT_STD}.gguf"
    if path.is_file():
        print(f"reusing {path}", flush=True)
        return path
    work.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # renamed once whole: an interrupted write is not reused
    started = time.perf_counter()
    write_synthetic_gguf(partial, SHAPES[shape_name], type_name, seed)
    partial.rename(path)
    writer_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    print(f"wrote {path} ({path.stat().st_size / GIB:.2f} GiB) in {time.perf_counter() - started:.0f} s, "
          f"this process's peak {writer_peak:.2f} GiB", flush=True)
    return path


# -- running a measured process


def run_measured(command: list[str], environment: dict[str, str]) -> tuple[str, float, float]:
    """(stdout, wall seconds, peak resident GiB) of `command`, run to its end; its peak is the
    ru_maxrss that os.wait4 returns for it. Exits with its stderr's tail if it fails."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=environment, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            tail = "\n".join(err.read().strip().splitlines()[-5:]) or "no output"
            sys.exit(f"error: {' '.join(command[:4])} ... failed ({process.returncode}):\n{tail}")
        return out.read(), seconds, usage.ru_maxrss * 1024 / GIB


def thread_environment(threads: int) -> dict[str, str]:
    return {**START_ENVIRONMENT, "NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
            "OPENBLAS_NUM_THREADS": str(threads)}


def folder_size(folder: Path) -> dict[str, float]:
    """Each file's size in GiB as the folder holds it, and the total: a link (`pyml import-gguf`'s
    source.gguf) counts its own bytes, not the file it names, which the folder does not copy."""
    sizes = {str(path.relative_to(folder)): path.lstat().st_size / GIB
             for path in sorted(folder.rglob("*")) if path.is_file() or path.is_symlink()}
    return sizes | {"total": sum(sizes.values())}


def import_gguf(gguf_path: Path, folder: Path, threads: int) -> dict:
    shutil.rmtree(folder, ignore_errors=True)  # a fresh import, every time
    _, seconds, peak = run_measured([sys.executable, "-m", "pyml.cli", "import-gguf", str(gguf_path),
                                     "--out", str(folder)], thread_environment(threads))
    sizes = folder_size(folder)
    print(f"pyml import-gguf: {seconds:.1f} s, peak {peak:.2f} GiB, folder {sizes['total']:.2f} GiB", flush=True)
    return {"seconds": seconds, "peak_rss_gib": peak, "folder_gib": sizes}


def prompt_ids(folder: Path) -> list[int]:
    """The longest prompt's ids: the start of CPython's reference docs, in the folder's tokenizer."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids[: max(PROMPT_LENGTHS)]
    assert len(ids) == max(PROMPT_LENGTHS), "the docs are far longer than any prompt here"
    return ids


def generation(system: str, folder: Path, gguf_path: Path, ids_path: Path, threads: int,
               new_tokens: int, repeats: int) -> dict:
    """One system's figures, from a fresh process of this script (`--system`)."""
    command = [sys.executable, __file__, "--system", system, "--folder", str(folder), "--gguf",
               str(gguf_path), "--ids", str(ids_path), "--threads", str(threads), "--new-tokens",
               str(new_tokens), "--repeats", str(repeats), "--spawned-at", repr(time.time())]
    stdout, _, peak = run_measured(command, thread_environment(threads))
    return json.loads(stdout.strip().splitlines()[-1]) | {"peak_rss_gib": peak}


def serving(system: str, folder: Path, gguf_path: Path, llama_server: Path, threads: int,
            new_tokens: int) -> dict:
    """Peak resident GiB of a server (`system`: pyml or llama.cpp) that answered SERVE_SEQUENCES
    concurrent chat requests, and the completion tokens it sent."""
    from serve import free_port, round_of  # bench/ is on sys.path as a script

    port = free_port()
    if system == "pyml":
        command = [sys.executable, "-m", "pyml.cli", "serve", "--model", str(folder), "--port", str(port),
                   "--max-sequences", str(SERVE_SEQUENCES), "--context", str(SERVE_CONTEXT)]
    else:
        command = [str(llama_server), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(SERVE_SEQUENCES), "-c", str(SERVE_SEQUENCES * SERVE_CONTEXT), "-t",
                   str(threads), "--jinja", "--no-webui", "--log-disable"]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=thread_environment(threads), text=True)
        try:
            wait_until_healthy(process, url, log)
            answered = round_of(url, SERVE_SEQUENCES, 1, new_tokens)
            if answered["tokens"] == 0:  # round_of counts an error answer as a stream of no tokens
                sys.exit(f"error: {process.args[0]} answered {SERVE_SEQUENCES} chat requests with no tokens")
        finally:
            process.terminate()
        deadline = time.monotonic() + 60
        while (reaped := os.wait4(process.pid, os.WNOHANG))[0] == 0:  # its rusage comes with the reaping
            if time.monotonic() > deadline:
                process.kill()
            time.sleep(0.2)
    process.returncode = os.waitstatus_to_exitcode(reaped[1])
    peak = reaped[2].ru_maxrss * 1024 / GIB
    print(f"{system} serving: {answered['requests']} requests, {answered['tokens']} tokens, peak {peak:.2f} GiB",
          flush=True)
    return {"peak_rss_gib": peak, "requests": answered["requests"], "tokens": answered["tokens"]}


def wait_until_healthy(process: subprocess.Popen, url: str, log) -> None:
    """Returns once `url`/health answers 200 (llama-server answers 503 while it loads)."""
    import httpx2 as httpx

    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            sys.exit(f"error: {process.args[0]} did not start serving:\n{log.read()[-2000:]}")
        time.sleep(0.5)


# -- inside a generating process


def measure_in_this_process(system: str, folder: Path, gguf_path: Path, ids: list[int], threads: int,
                            new_tokens: int, repeats: int, spawned_at: float) -> dict:
    """Load the system, take the cold first token after the short prompt, then measure."""
    from generate import llamacpp_model, llamacpp_run, ours_run  # bench/ is on sys.path as a script

    short, long = ids[: PROMPT_LENGTHS[0]], ids[: PROMPT_LENGTHS[1]]
    context = len(long) + new_tokens
    if system in ("pyml", "pyml_q8_0"):
        from pyml.generate import decoding as pyml_generation

        pyml_generation.load_tokenizer(folder)  # as `pyml generate` does, before the weights
        activations = "q8_0" if system == "pyml_q8_0" else "f32"
        model = pyml_generation.load_decoder(folder, activations=activations)
        described = model.describe_formats()
        run = lambda prompt, tokens: ours_run(model, prompt, tokens, set())  # noqa: E731
    else:
        from llama_cpp.llama_cpp import llama_print_system_info

        model = llamacpp_model(gguf_path, context, len(long), threads, extra_buffer_types=True)
        described = llama_print_system_info().decode().strip(" |")
        run = lambda prompt, tokens: llamacpp_run(model, prompt, tokens, set())  # noqa: E731
    run(short, 1)
    first_token_s = time.time() - spawned_at
    prefill_short, prefill_long, decode = [], [], []
    for _ in range(repeats):
        out, prefill_seconds, decode_seconds = run(short, new_tokens)
        assert len(out) == new_tokens
        prefill_short.append(len(short) / prefill_seconds)
        decode.append((new_tokens - 1) / decode_seconds)  # the first new token came with the prefill
        _, prefill_seconds, _ = run(long, 1)
        prefill_long.append(len(long) / prefill_seconds)
    return {"cold_first_token_s": first_token_s, "described": described,
            f"prefill_{len(short)}_tokens_per_s": statistics.median(prefill_short),
            f"prefill_{len(long)}_tokens_per_s": statistics.median(prefill_long),
            "decode_tokens_per_s": statistics.median(decode)}


# -- the report


def report_lines(report: dict) -> list[str]:
    gguf_gib = report["gguf_gib"]
    imported = report["import"]
    folder_gib = imported["folder_gib"]["total"]
    systems = report["generation"]
    lines = [
        f"Scale: {report['shape']} shape ({report['file']}, {gguf_gib:.2f} GiB, random weights, "
        f"{report['type'].upper()}), {report['date']}: {report['machine']}; {report['threads']} threads "
        f"for every system; prompts of {' and '.join(map(str, PROMPT_LENGTHS))} tokens of CPython's "
        f"reference docs, {report['new_tokens']} new tokens (greedy), medians of {report['repeats']} "
        f"runs; cold first token: a fresh process after a warm-up run (pyml's package compiled and "
        f"cached, the file in the page cache); peak RSS: ru_maxrss from os.wait4.",
        "",
        f"`pyml import-gguf`: {imported['seconds']:.1f} s, peak RSS {imported['peak_rss_gib']:.2f} GiB; "
        f"folder {folder_gib * 1024:.1f} MiB = {folder_gib / gguf_gib:.3f}x the GGUF ("
        + ", ".join(f"{name} {size * 1024:.1f}" for name, size in imported["folder_gib"].items()
                    if name != "total" and size * 1024 >= 1) + " MiB; source.gguf is a link to the GGUF).",
        "",
        "| | " + " | ".join(SYSTEMS[name] for name in systems) + " | pyml / llama.cpp |",
        "| --- |" + " --- |" * (len(systems) + 1),
    ]
    rows = [("peak RSS, GiB", "peak_rss_gib", "{:.2f}")]
    rows += [(f"prefill at {n} tokens, tokens/s", f"prefill_{n}_tokens_per_s", "{:.1f}") for n in PROMPT_LENGTHS]
    rows += [("decode, tokens/s", "decode_tokens_per_s", "{:.1f}"),
             ("cold time to first token, s", "cold_first_token_s", "{:.2f}")]
    for label, key, form in rows:
        cells = [form.format(result[key]) for result in systems.values()]
        ratio = systems["pyml"][key] / systems["llamacpp"][key]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    served = report["serving"]
    # one pyml server, with pyml serve's defaults: the pyml_q8_0 column has no serving figure
    serving_cells = [f"{served[name]['peak_rss_gib']:.2f}" if name in served else "" for name in systems]
    ratio = (f"{served['pyml']['peak_rss_gib'] / served['llamacpp']['peak_rss_gib']:.2f}x"
             if "llamacpp" in served else "")
    lines.append(f"| peak RSS serving {SERVE_SEQUENCES} concurrent requests, GiB | " + " | ".join(serving_cells)
                 + f" | {ratio} |")
    if "llamacpp" not in served:
        lines += ["", "llama-server not run: no llama-server given (`make bench-serve` builds it; "
                  "`--llama-server PATH`)."]
    lines += ["", f"pyml's weight formats: {systems['pyml']['described']}; with --activations q8_0: "
              f"{systems['pyml_q8_0']['described']}.",
              f"llama.cpp's CPU backend (llama_print_system_info): {systems['llamacpp']['described']}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE)
    parser.add_argument("--type", choices=["q8_0", "q4_0"], default=DEFAULT_TYPE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument("--llama-server", type=Path, default=ROOT / ".venv/share/llama.cpp/build/bin/llama-server",
                        help="llama.cpp's server, for the serving row (`make bench-serve` builds it)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pyml-bench-scale",
                        help="where the GGUF is cached and the folder imported")
    for internal in ("--system", "--folder", "--gguf", "--ids", "--spawned-at"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        ids = json.loads(Path(args.ids).read_text())
        print(json.dumps(measure_in_this_process(args.system, Path(args.folder), Path(args.gguf), ids,
                                                 args.threads, args.new_tokens, args.repeats,
                                                 float(args.spawned_at))))
        return
    if args.new_tokens < 2:
        sys.exit("error: --new-tokens must be at least 2 (decode speed counts the tokens after the first)")

    gguf_path = synthetic_gguf(args.work, args.shape, args.type, args.seed)
    folder = args.work / f"{gguf_path.stem}-imported"
    imported = import_gguf(gguf_path, folder, args.threads)
    ids_path = args.work / "prompt_ids.json"
    ids_path.write_text(json.dumps(prompt_ids(folder)))
    results = {}
    for system in SYSTEMS:
        generation(system, folder, gguf_path, ids_path, args.threads, 2, 1)  # the warm-up run
        results[system] = generation(system, folder, gguf_path, ids_path, args.threads,
                                     args.new_tokens, args.repeats)
        print(system, json.dumps(results[system]), flush=True)
    servers = ["pyml"] + (["llamacpp"] if args.llama_server.is_file() else [])
    served = {system: serving(system, folder, gguf_path, args.llama_server, args.threads, args.new_tokens)
              for system in servers}

    from train_step import machine_description

    report = {"shape": args.shape, "dims": asdict(SHAPES[args.shape]), "type": args.type,
              "file": gguf_path.name, "gguf_gib": gguf_path.stat().st_size / GIB, "seed": args.seed,
              "date": date.today().isoformat(), "machine": machine_description(), "threads": args.threads,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "import": imported,
              "generation": results, "serving": served,
              "llama_server": str(args.llama_server) if "llamacpp" in served else None}
    stem = "scale" if (args.shape, args.type) == (DEFAULT_SHAPE, DEFAULT_TYPE) else f"scale_{args.shape}_{args.type}"
    lines = report_lines(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
