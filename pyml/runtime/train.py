"""`pyml train`: train a generated package on real data, with held-out loss, checkpoints, resume.

Decoders train on next-token prediction over a text corpus (`pyml.runtime.data`), tokenised with
the tokenizer of the `--init` model folder; sequential models train on scikit-learn's digits
(`pyml.runtime.digits`). `train` resolves the options and builds the data and the model;
`run_training` is the loop itself, which the tests drive directly with their own data.

Resuming is bit-identical: a checkpoint holds the weights, the optimizer's moments and step count,
and the data order's position and generator state, and nothing else in the loop is random.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from tqdm import tqdm

from pyml.errors import PymlError
from pyml.packages import package_for
from pyml.runtime.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_state,
)
from pyml.runtime.data import (
    DEFAULT_CORPUS_NAME,
    Batches,
    encode_documents,
    fingerprint,
    load_corpus,
    next_token_pairs,
    pack,
    split_documents,
    start_id,
)
from pyml.runtime.distributed import SingleProcess
from pyml.runtime.lora import (LORA_FLAGS, adapter_files, base_weights_digest, lora_settings,
                               lora_spec)
from pyml.runtime.loss_curve import write_loss_curve
from pyml.runtime.model_folder import folder_files, weights_file

IGNORED_TARGET = -100  # the generated losses skip this target, as torch's cross_entropy does
LOSS_CURVE_FILE = "loss.png"
# Options that fix what a run computes: a resume must use the values the checkpoint was made with.
FIXED_ON_RESUME = ("batch", "seq", "lr", "weight_decay", "max_grad_norm", "seed", "dtype")
# Defaults that differ by model form: a 135M decoder fine-tunes with small batches and a small
# learning rate; the digits MLP learns from scratch with larger ones.
FORM_DEFAULTS = {
    "decoder": {"batch": 2, "seq": 128, "lr": 1e-4},
    "sequential": {"batch": 64, "seq": None, "lr": 1e-3},
}
COMMON_DEFAULTS = {
    "steps": 200,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "eval_every": 50,
    "eval_batches": 4,
    "checkpoint_every": 100,
    "seed": 0,
    "dtype": "float32",
    "device": "cpu",
}


@dataclass(frozen=True)
class TrainingConfig:
    """Everything a run was asked to do; saved in every checkpoint's state.json."""

    spec: str  # the spec's name
    steps: int  # the step to stop at (counted from the start of the run, across resumes)
    batch: int
    seq: int | None  # tokens per sequence (decoders only)
    lr: float
    weight_decay: float
    max_grad_norm: float  # 0 turns gradient clipping off
    eval_every: int
    eval_batches: int  # held-out batches per evaluation (decoders; the MLP uses all held-out data)
    checkpoint_every: int
    seed: int
    dtype: str
    device: str
    init: str | None = None
    data: str | None = None
    lora: dict | None = None  # the [lora] table --lora-rank added to the spec: rank, alpha, targets
    base_weights: str | None = None  # a LoRA run's base_weights_digest of its --init folder


@dataclass
class TrainingResult:
    step: int
    train_losses: list[float]  # train_losses[i] is the loss of step i + 1
    evaluations: list[dict]  # {"step", "loss", and "accuracy" for classifiers}
    checkpoint: Path | None
    interrupted: bool


def train(
    spec_path: Path | None,
    init: Path | None = None,
    data: Path | None = None,
    steps: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    out: Path = Path("runs/train"),
    lr: float | None = None,
    weight_decay: float | None = None,
    eval_every: int | None = None,
    checkpoint_every: int | None = None,
    seed: int | None = None,
    resume: bool = False,
    max_grad_norm: float | None = None,
    dtype: str | None = None,
    device: str | None = None,
    eval_batches: int | None = None,
    progress: bool = True,
    group=None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    lora_targets: list[str] | None = None,
) -> TrainingResult:
    """Train the generated package of the spec at `spec_path` (default: the `init` folder's
    spec.toml); options left as None take the checkpoint's values when resuming, else the
    defaults above. Prints a summary at the end. `group` is this process's part in data-parallel
    training (`pyml.runtime.distributed`). `lora_rank` (with `lora_alpha` and `lora_targets`)
    trains LoRA adapters instead (see above)."""
    from pyml.packages import spec_file
    from pyml.spec import SequentialModel, load_spec

    if spec_path is None:
        if init is None or not Path(init).is_dir():
            raise PymlError("give --spec, or --init with a model folder (its spec.toml is trained)")
        spec_path = spec_file(Path(init))
    spec = load_spec(spec_path)
    form = "sequential" if isinstance(spec, SequentialModel) else "decoder"
    given_lora = {"rank": lora_rank, "alpha": lora_alpha, "targets": lora_targets}
    given = {
        "steps": steps, "batch": batch, "seq": seq, "lr": lr, "weight_decay": weight_decay,
        "max_grad_norm": max_grad_norm, "eval_every": eval_every, "eval_batches": eval_batches,
        "checkpoint_every": checkpoint_every, "seed": seed, "dtype": dtype, "device": device,
        "init": None if init is None else str(init), "data": None if data is None else str(data),
    }  # fmt: skip
    if resume:
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise PymlError(f"{out}: no checkpoint to resume from; run without --resume to start")
        base = read_state(checkpoint)["config"]
        for name in FIXED_ON_RESUME:
            if given.get(name) is not None and given[name] != base[name]:
                raise PymlError(
                    f"--{name.replace('_', '-')} {given[name]} differs from the checkpoint's "
                    f"{base[name]} ({checkpoint}); leave it out to resume, or start a new --out"
                )
        if base["spec"] != spec.name:
            raise PymlError(
                f"{checkpoint} was trained from spec '{base['spec']}', not '{spec.name}'"
            )
        check_lora_on_resume(given_lora, base.get("lora"), checkpoint)
        lora = base.get("lora")
    else:
        base = {**COMMON_DEFAULTS, **FORM_DEFAULTS[form], "spec": spec.name}
        lora = new_lora(given_lora, form)
    values = {**base, **{name: value for name, value in given.items() if value is not None},
              "lora": lora}
    if lora is not None and values.get("init") is not None:
        digest = base_weights_digest(Path(values["init"]))
        if resume and base.get("base_weights") not in (None, digest):
            raise PymlError(f"{weights_file(Path(values['init']))} holds other weights than "
                            f"the base {checkpoint}'s adapters were trained on; resume with that "
                            "base as --init, or start a new --out")
        values["base_weights"] = digest
    config = TrainingConfig(
        **{field.name: values.get(field.name) for field in dataclasses.fields(TrainingConfig)}
    )
    check_config(config)
    if config.lora is None:
        package = package_for(spec_path)
    else:
        spec, package = lora_spec(spec_path, config.lora)
    if form == "sequential":
        train_pairs, held_out_pairs = digits_pairs(config, package)
    else:
        train_pairs, held_out_pairs = text_pairs(config, package)
    dtype_and_device = {"dtype": np.dtype(config.dtype), "device": config.device}
    lora_table = spec.lora if form == "decoder" else None  # the spec's own, or the flags'
    if lora_table is not None:
        # a resume then loads the checkpoint's adapters over the freshly initialised ones
        model = package.Model.from_base(Path(config.init), seed=config.seed, **dtype_and_device)
        model_files = adapter_files(lora_table, Path(config.init))
    else:
        if resume or config.init is not None:
            model = package.Model(**dtype_and_device)
            if not resume:  # a resume loads the checkpoint's weights instead
                model.load_tensors(*init_weights(Path(config.init)))
        else:
            model = package.Model.initialized(seed=config.seed, **dtype_and_device)
        model_files = folder_files(spec_path, None if config.init is None else Path(config.init))
    result = run_training(
        package, model, train_pairs, held_out_pairs, config, Path(out), resume, progress, group,
        model_files,
    )
    print(describe_result(result, Path(out)))
    return result


def run_training(
    package: ModuleType,
    model,
    train_pairs: tuple[np.ndarray, np.ndarray],
    held_out_pairs: tuple[np.ndarray, np.ndarray],
    config: TrainingConfig,
    out: Path,
    resume: bool = False,
    progress: bool = True,
    group=None,
    model_files: dict[str, bytes] | None = None,
) -> TrainingResult:
    """Train `model` (a `package.Model`) on (inputs, targets) rows until step `config.steps`,
    evaluating (first before step 1, the baseline), checkpointing into `out` and writing
    `out/loss.png` as the config says. With `resume`, first restore `out`'s latest checkpoint into
    the model, the optimizer and the data order. Ctrl-C stops after the step in flight and saves
    it; a non-finite loss raises PymlError and keeps the last checkpoint. `group` (default: one
    process) splits each batch across ranks; only its root writes files and shows progress. Each
    checkpoint is a model folder holding `model_files` (`model_folder.folder_files`) beside the
    weights."""
    out = Path(out)
    group = group or SingleProcess()
    group.check_batch(config.batch)
    optimizer = group.optimizer(
        package,
        model,
        lr=config.lr,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm or None,
    )
    batches = Batches(train_pairs, config.batch, config.seed)
    data_fingerprint = fingerprint(*train_pairs, *held_out_pairs)
    checkpoint = latest_checkpoint(out)
    if resume:
        if checkpoint is None:
            raise PymlError(f"{out}: no checkpoint to resume from; run without --resume to start")
        state = load_checkpoint(checkpoint, model, optimizer)
        if state["data_fingerprint"] != data_fingerprint:
            raise PymlError(
                f"{checkpoint}: the training data differ from the data this run started on "
                "(another --data, --init tokenizer or Python version?); resume on the same data"
            )
        batches.load_state(state["data"])
        step, train_losses, evaluations = state["step"], state["train_losses"], state["evaluations"]
    else:
        if checkpoint is not None:
            raise PymlError(
                f"{out} already holds a checkpoint ({checkpoint.name}): pass --resume to continue "
                "that run, or choose another --out"
            )
        step, train_losses, evaluations = 0, [], []

    def save() -> Path:
        state = {
            "step": step,
            "spec": config.spec,
            "config": dataclasses.asdict(config),
            "data": batches.state(),
            "data_fingerprint": data_fingerprint,
            "train_losses": train_losses,
            "evaluations": evaluations,
        }
        saved = group.save_checkpoint(out, model, optimizer, state, model_files)
        if group.is_root:
            write_loss_curve(out / LOSS_CURVE_FILE, train_losses, evaluations, config)
        return saved

    examples_per_step = config.batch * (config.seq or 1)
    unit = "tok/s" if config.seq else "examples/s"
    # The first step of a run also compiles the kernels and allocates the buffers: the rate
    # shown leaves it out once there are others.
    seconds_timed, steps_timed, first_step_of_run = 0.0, 0, step + 1
    with (
        tqdm(total=config.steps, initial=step, disable=not (progress and group.is_root),
             unit="step") as bar,
        stop_requested_by_ctrl_c(bar, group.stop_signals) as stop,
    ):
        if step == 0 and group.is_root:
            baseline = {"step": 0, **evaluate(model, held_out_pairs, config)}
            evaluations.append(baseline)
            bar.write(describe_evaluation(baseline))
        while step < config.steps:
            inputs, targets = batches.next_batch()
            started = time.perf_counter()
            try:
                loss = group.train_step(package, model, optimizer, inputs, targets, stop)
            except PymlError as error:
                if group.is_root:
                    write_loss_curve(out / LOSS_CURVE_FILE, train_losses, evaluations, config)
                # the same class: an error every rank agreed on stays one (GroupError)
                raise type(error)(
                    f"training stopped at step {step + 1}: {error}; {last_good(checkpoint)}"
                ) from None
            seconds = time.perf_counter() - started
            step += 1
            train_losses.append(loss)
            if step == first_step_of_run:
                rate = examples_per_step / seconds
            else:
                seconds_timed, steps_timed = seconds_timed + seconds, steps_timed + 1
                rate = examples_per_step * steps_timed / seconds_timed
            bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} {unit}", refresh=False)
            bar.update()
            if stop.requested:
                checkpoint = save()
                return TrainingResult(step, train_losses, evaluations, checkpoint, True)
            if group.is_root and (step % config.eval_every == 0 or step == config.steps):
                evaluation = {"step": step, **evaluate(model, held_out_pairs, config)}
                evaluations.append(evaluation)
                bar.write(describe_evaluation(evaluation))
            if step % config.checkpoint_every == 0 or step == config.steps:
                checkpoint = save()
    return TrainingResult(step, train_losses, evaluations, checkpoint, False)


def new_lora(given: dict, form: str) -> dict | None:
    """The [lora] table a new run adds to its spec: None without --lora-rank."""
    if given["rank"] is None:
        if given["alpha"] is not None or given["targets"] is not None:
            raise PymlError("--lora-alpha and --lora-targets need --lora-rank")
        return None
    if form != "decoder":
        raise PymlError("--lora-rank adapts a decoder's projections; this spec is a sequential model")
    return lora_settings(given["rank"], given["alpha"], given["targets"])


def check_lora_on_resume(given: dict, recorded: dict | None, checkpoint: Path) -> None:
    """Refuse LoRA flags that differ from what the checkpoint's run trained."""
    for name, value in given.items():
        if value is None:
            continue
        if recorded is None:
            raise PymlError(f"{LORA_FLAGS[name]}: {checkpoint} is not a LoRA run (it was trained "
                            "without --lora-rank); leave it out to resume, or start a new --out")
        if value != recorded[name]:
            shown = ",".join(value) if name == "targets" else value
            theirs = ",".join(recorded[name]) if name == "targets" else recorded[name]
            raise PymlError(f"{LORA_FLAGS[name]} {shown} differs from the checkpoint's {theirs} "
                            f"({checkpoint}); leave it out to resume, or start a new --out")


def last_good(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "no checkpoint was written yet; lower --lr or --max-grad-norm and start again"
    return (
        f"the last good checkpoint, {checkpoint}, is kept; lower --lr or --max-grad-norm "
        "and continue from it with --resume"
    )


class StopRequest:
    requested = False


@contextmanager
def stop_requested_by_ctrl_c(bar: tqdm, signals=(signal.SIGINT,)):
    """While inside, Ctrl-C (or another of `signals`: SIGTERM too, on a rank of a distributed run)
    sets `.requested` instead of raising KeyboardInterrupt in the middle of a step (where the
    weights may be half updated); the loop then saves the finished step and returns. A second one
    aborts at once, keeping the last checkpoint."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be installed from the main thread
        return

    def request_stop(signum, frame):
        stop.requested = True
        signal.signal(signum, previous[signum])
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        bar.write(f"{name}: saving a checkpoint after this step ({name} again to abort without it)")

    previous = {signum: signal.signal(signum, request_stop) for signum in signals}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def evaluate(model, held_out_pairs: tuple[np.ndarray, np.ndarray], config: TrainingConfig) -> dict:
    """Mean held-out cross-entropy over a fixed set of held-out rows, from forward passes only
    (the gradients are left alone); classifiers also get their accuracy. Decoders use the first
    `eval_batches` batches of the held-out sequences, classifiers every held-out example."""
    inputs, targets = held_out_pairs
    if config.seq is None:
        batch_size, batch_count = len(inputs), 1
    else:
        batch_size = min(config.batch, len(inputs))
        batch_count = min(config.eval_batches, len(inputs) // batch_size)
    loss_sum, counted, correct = 0.0, 0, 0
    for index in range(batch_count):
        rows = slice(index * batch_size, (index + 1) * batch_size)
        batch_loss_sum, batch_counted, batch_correct = cross_entropy_sum(
            model.forward(inputs[rows]), targets[rows]
        )
        loss_sum, counted, correct = (
            loss_sum + batch_loss_sum, counted + batch_counted, correct + batch_correct
        )  # fmt: skip
    evaluation = {"loss": loss_sum / counted}
    if config.seq is None:
        evaluation["accuracy"] = correct / counted
    return evaluation


def cross_entropy_sum(logits: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
    """(summed cross-entropy in nats, targets counted, argmax hits) of `logits` (..., classes)
    against integer `targets` (...), skipping IGNORED_TARGET; log-softmax shifted by each row's
    maximum so that no exponential overflows."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    kept = targets != IGNORED_TARGET
    logits, targets = logits[kept], targets[kept]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_normalisers = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))
    losses = log_normalisers - shifted[np.arange(len(targets)), targets]
    hits = int((logits.argmax(axis=1) == targets).sum())
    return float(losses.sum()), len(targets), hits


def describe_evaluation(evaluation: dict) -> str:
    text = f"step {evaluation['step']}: held-out loss {evaluation['loss']:.4f}"
    if "accuracy" in evaluation:
        text += f", accuracy {evaluation['accuracy']:.4f}"
    return text


def describe_result(result: TrainingResult, out: Path) -> str:
    if result.interrupted:
        head = f"stopped by Ctrl-C after step {result.step}"
    else:
        head = f"trained to step {result.step}"
    if result.evaluations and not result.interrupted:
        head += f"; {describe_evaluation(result.evaluations[-1]).split(': ', 1)[1]}"
    lines = [head]
    if result.checkpoint is not None:
        lines.append(f"checkpoint: {result.checkpoint}")
        lines.append(f"loss curve: {out / LOSS_CURVE_FILE}")
    if result.interrupted:
        lines.append("continue with the same command and --resume")
    return "\n".join(lines)


def check_config(config: TrainingConfig) -> None:
    for name in ("steps", "batch", "eval_every", "eval_batches", "checkpoint_every"):
        if getattr(config, name) < 1:
            raise PymlError(f"--{name.replace('_', '-')} must be at least 1")
    if config.seq is not None and config.seq < 1:
        raise PymlError("--seq must be at least 1")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise PymlError(f"--lr must be a positive number, got {config.lr}")
    if config.weight_decay < 0 or config.max_grad_norm < 0:
        raise PymlError("--weight-decay and --max-grad-norm must not be negative")
    if config.dtype not in ("float32", "float64"):
        raise PymlError(f"--dtype must be float32 or float64, got {config.dtype}")


def init_weights(init: Path) -> tuple[dict[str, np.ndarray], str]:
    """The tensors of `--init` (a model folder holding model.safetensors, or the file itself)."""
    from pyml.runtime.safetensors_io import read_safetensors

    path = weights_file(init)
    return read_safetensors(path), str(path)


def digits_pairs(config: TrainingConfig, package: ModuleType):
    """Train and held-out (images, labels) of the digits data set, checked against the spec."""
    from pyml.runtime.digits import CLASSES, PIXELS, load_digits_split

    if config.data is not None:
        raise PymlError(
            "sequential models train on scikit-learn's digits data set; leave out --data"
        )
    spec_model = package.model
    if (spec_model.INPUT_DIM, spec_model.OUTPUT_DIM) != (PIXELS, CLASSES):
        raise PymlError(
            f"spec '{config.spec}' maps {spec_model.INPUT_DIM} inputs to {spec_model.OUTPUT_DIM} "
            f"classes; the digits data set needs {PIXELS} inputs and {CLASSES} classes"
        )
    return load_digits_split(seed=config.seed)


def text_pairs(config: TrainingConfig, package: ModuleType):
    """Train and held-out (input ids, target ids) of the corpus, split by document, tokenised
    with the `--init` folder's tokenizer, packed into sequences of `config.seq` tokens."""
    from tokenizers import Tokenizer

    spec_model = package.model
    if config.init is None:
        raise PymlError(
            "decoders need --init: a model folder (from `pyml import-gguf`) whose tokenizer.json "
            "tokenises the training text and whose model.safetensors holds the starting weights"
        )
    if config.seq > spec_model.MAX_SEQ_LEN:
        raise PymlError(
            f"--seq {config.seq} exceeds spec '{config.spec}''s max_seq_len {spec_model.MAX_SEQ_LEN}"
        )
    init = Path(config.init)
    tokenizer_path, config_path = init / "tokenizer.json", init / "config.json"
    for path in (tokenizer_path, config_path):
        if not path.is_file():
            raise PymlError(
                f"{path}: missing; --init must be a model folder from `pyml import-gguf`"
            )
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    if tokenizer.get_vocab_size() > spec_model.VOCAB:
        raise PymlError(
            f"{tokenizer_path} has {tokenizer.get_vocab_size()} tokens, more than spec "
            f"'{config.spec}''s vocabulary of {spec_model.VOCAB}"
        )
    eos_id = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
    if not isinstance(eos_id, int):
        raise PymlError(f"{config_path}: no integer eos_token_id to end each document with")

    def encode_batch(texts: list[str]) -> list[list[int]]:
        # framed as the tokenizer frames any text: Gemma's starts each document with <bos>
        return [encoding.ids for encoding in tokenizer.encode_batch(texts)]

    start = start_id(lambda text, special: tokenizer.encode(text, add_special_tokens=special).ids)
    documents = load_corpus(None if config.data is None else Path(config.data))
    train_documents, held_out_documents = split_documents(documents, seed=config.seed)
    train_ids = encode_documents(train_documents, encode_batch, eos_id)
    held_out_ids = encode_documents(held_out_documents, encode_batch, eos_id)
    print(
        f"data: {config.data or DEFAULT_CORPUS_NAME}: {len(train_documents)} train documents "
        f"({len(train_ids):,} tokens), {len(held_out_documents)} held out "
        f"({len(held_out_ids):,} tokens)"
    )
    return next_token_pairs(pack(train_ids, config.seq, start)), next_token_pairs(
        pack(held_out_ids, config.seq, start)
    )
