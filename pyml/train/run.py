"""`pyml train`: train a generated package on real data, with held-out loss, checkpoints, resume.

Decoders train on next-token prediction over a text corpus (`pyml.train.data`), tokenised with
the tokenizer of the `--init` model folder; sequential models train on scikit-learn's digits
(`pyml.train.digits`). `train` resolves the options and builds the data and the model;
`run_training` is the loop itself, which the tests drive directly with their own data.

Resuming is bit-identical: a checkpoint holds the weights, the optimizer's moments and step count,
and the data order's position and generator state, and nothing else in the loop is random.
"""

from __future__ import annotations

import dataclasses
import sys
from math import prod
from pathlib import Path
from types import ModuleType

import numpy as np

from pyml.errors import PymlError
from pyml.formats.model_folder import SPEC_FILE, folder_files
from pyml.weight_formats import GGMLType
from pyml.formats.stored_tensors import StoredFolder, size_text, stored_weights
from pyml.outputs import check_destination
from pyml.packages import package_for
from pyml.train import examples
from pyml.train.checkpoint import (
    is_run_folder,
    latest_checkpoint,
    read_state,
    refuse_used_run_folder,
)
from pyml.train.config import (
    COMMON_DEFAULTS,
    FIXED_ON_RESUME,
    FORM_DEFAULTS,
    LORA_LR,
    PREFERENCE_LORA_LR,
    PREFERENCE_LR,
    TrainingConfig,
    check_config,
    with_steps_for_epochs,
)
from pyml.train.data import (
    DEFAULT_CORPUS_NAME,
    load_corpus,
    split_documents,
)
from pyml.train.folder_data import FolderTokens
from pyml.train.loop import TrainingResult, describe_result, run_training
from pyml.train.preference import DEFAULT_BETA
from pyml.train.lora import LORA_FLAGS, adapter_files, base_weights_digest, lora_settings, lora_spec


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
    train_on: str | None = None,
    long_examples: str | None = None,
    eval_data: Path | None = None,
    accumulate: int | None = None,
    schedule: str | None = None,
    warmup_steps: int | None = None,
    min_lr: float | None = None,
    log: str | None = None,
    packing: bool | None = None,
    epochs: float | None = None,
    keep: int | None = None,
    recompute: bool | None = None,
    method: str | None = None,
    beta: float | None = None,
    loss_type: str | None = None,
    precision: str | None = None,
) -> TrainingResult:
    """Train the generated package of the spec at `spec_path` (default: the `init` folder's
    spec.toml, or when resuming the checkpoint's); options left as None take the checkpoint's
    values when resuming, else the defaults in `pyml.train.config`. `steps`, when given, overrides
    `epochs` (as transformers' max_steps overrides num_train_epochs). Prints a summary at the end. `group` is this process's part in data-parallel
    training (`pyml.train.distributed`). `lora_rank` (with `lora_alpha` and `lora_targets`)
    trains LoRA adapters instead (see above). `recompute` trades time for a decoder's activation
    memory (`DecoderModel.recompute`). `method` dpo or orpo trains on preference pairs
    (`pyml.train.preference`) with its `beta` and DPO's `loss_type`. `precision` bf16 runs the
    linear layers' products in bf16 (`Model.set_precision`)."""
    from pyml.packages import spec_file
    from pyml.spec import SequentialModel, load_spec

    out = Path(out)
    # the run folder first, before any spec, weights or data is loaded
    if resume:
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise PymlError(f"{out}: no checkpoint to resume from; run without --resume to start")
        base = read_state(checkpoint)["config"]
    else:
        check_destination(out, "a training run (its checkpoints and loss.png)", is_run_folder, None)
        refuse_used_run_folder(out)
    if spec_path is None and resume and init is None:
        spec_path = resumed_spec(checkpoint, base)
    elif spec_path is None:
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
        "train_on": train_on, "long_examples": long_examples,
        "eval_data": None if eval_data is None else str(eval_data), "accumulate": accumulate,
        "schedule": schedule, "warmup_steps": warmup_steps, "min_lr": min_lr, "log": log,
        "packing": packing, "epochs": epochs, "keep": keep, "recompute": recompute,
        "method": method, "beta": beta, "loss_type": loss_type, "precision": precision,
    }  # fmt: skip
    if resume:
        for name in FIXED_ON_RESUME:
            if given.get(name) is not None and given[name] != base.get(name):
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
        if lora is not None:
            base["lr"] = LORA_LR
        if method in ("dpo", "orpo"):
            for name, flag in (("train_on", "--train-on"), ("long_examples", "--long-examples"),
                               ("packing", "--packing/--no-packing")):
                if given[name] is not None:
                    raise PymlError(f"{flag} shapes SFT examples; --method {method} trains on pairs "
                                    "(one sequence a row, a pair longer than --seq skipped): leave it out")
            base |= {"lr": PREFERENCE_LR if lora is None else PREFERENCE_LORA_LR, "beta": DEFAULT_BETA,
                     "loss_type": "sigmoid" if method == "dpo" else None}
    values = {**base, **{name: value for name, value in given.items() if value is not None},
              "lora": lora}
    if steps is not None:  # --steps overrides --epochs, as max_steps overrides num_train_epochs
        values["epochs"] = None
    elif epochs is not None:  # counted from the epochs once the data are loaded
        values["steps"] = None
    if lora is not None and values.get("init") is not None:
        digest = base_weights_digest(Path(values["init"]))
        if resume and base.get("base_weights") not in (None, digest):
            raise PymlError(f"--init {values['init']} holds other weights than "
                            f"the base {checkpoint}'s adapters were trained on; resume with that "
                            "base as --init, or start a new --out")
        values["base_weights"] = digest
    config = TrainingConfig(
        **{field.name: values.get(field.name) for field in dataclasses.fields(TrainingConfig)}
    )
    check_config(config)
    objective = config.objective()
    if objective is not None and form == "sequential":
        raise PymlError(f"--method {config.method} tunes a decoder on answer pairs; this spec is a sequential model")
    if config.recompute and form == "sequential":
        raise PymlError("--recompute runs a decoder's blocks again in the backward; "
                        "a sequential model has none: leave it out")
    if config.lora is None:
        package = package_for(spec_path)
    else:
        spec, package = lora_spec(spec_path, config.lora)
    dtype_and_device = {"dtype": np.dtype(config.dtype), "device": config.device}
    lora_table = spec.lora if form == "decoder" else None  # the spec's own, or the flags'
    if lora_table is not None:
        if config.device != "cpu":
            say_dense_copy(Path(config.init), config.dtype, "the base weights",
                           "; on the CPU the base's linear maps are read where they are stored")
        # a resume then loads the checkpoint's adapters over the freshly initialised ones
        model = package.Model.from_base(Path(config.init), seed=config.seed, **dtype_and_device)
        say_stored_base(model, Path(config.init))
        model_files = adapter_files(lora_table, Path(config.init))
    else:
        if resume or config.init is not None:
            model = package.Model(**dtype_and_device)
            if not resume:  # a resume loads the checkpoint's weights instead
                say_dense_copy(Path(config.init), config.dtype, "the weights for full fine-tuning")
                model.load_tensors(*stored_weights(Path(config.init), config.dtype))
        else:
            model = package.Model.initialized(seed=config.seed, **dtype_and_device)
        model_files = folder_files(spec_path, None if config.init is None else Path(config.init))
    model.set_precision(config.precision or "f32")
    if model.precision == "bf16" and (group is None or group.is_root):
        print("precision: the linear layers' products in bf16 (operands rounded to bfloat16, float32 sums); "
              "weights, gradients and AdamW in float32")
    if form == "decoder":
        model.recompute = bool(config.recompute)
        check_activation_memory(spec, config, 1 if group is None else group.ranks,
                                group is None or group.is_root)
    # the data after the model: a spec that does not fit the --init weights is named before an
    # option (--seq) that only does not fit the spec
    if form == "sequential":
        train_pairs, held_out_pairs = digits_pairs(config, package)
    elif objective is not None:
        train_pairs, held_out_pairs = preference_pairs(config, package, model, objective, out, resume,
                                                       group is None or group.is_root)
    else:
        train_pairs, held_out_pairs = text_pairs(config, package)
    if config.steps is None:
        config = with_steps_for_epochs(config, len(train_pairs[0]))
        print(f"steps: {config.steps} ({config.epochs:g} epochs of {len(train_pairs[0])} rows, "
              f"{config.batch * (config.accumulate or 1)} rows a step)")
    result = run_training(
        package, model, train_pairs, held_out_pairs, config, out, resume, progress, group,
        model_files, objective,
    )
    print(describe_result(result, out))
    return result


def check_activation_memory(spec, config: TrainingConfig, ranks: int, say: bool) -> None:
    """Say (where `say`) what the activations of a decoder's training step hold at the run's rows
    (each rank's share of --batch, two a pair), --seq and --dtype, with and without --recompute
    (`schedule.training_memory`), and refuse a CPU run whose activations do not fit the memory
    left once the weights are loaded, before they are allocated."""
    from pyml.codegen.emit import binary_size
    from pyml.codegen.lower import lower
    from pyml.codegen.schedule import plan_layout, training_memory
    from pyml.package.base import available_memory

    graph = lower(spec)
    layout = plan_layout(graph)
    # a preference pair is two rows: its chosen and its rejected sequence
    rows = -(-config.batch // ranks) * (1 if config.objective() is None else 2)
    kept, recomputed = (training_memory(graph, layout, rows, config.seq, np.dtype(config.dtype).itemsize,
                                        recompute)["activations"] for recompute in (False, True))
    if config.recompute:
        held = f"{binary_size(recomputed)} with --recompute ({binary_size(kept)} without)"
    else:
        held = f"{binary_size(kept)} ({binary_size(recomputed)} with --recompute)"
    what = f"the activations of a training step at batch {rows}x{config.seq}"
    available = available_memory()
    if config.device == "cpu" and (recomputed if config.recompute else kept) > available:
        remedy = "" if config.recompute or recomputed > available else "train with --recompute, or "
        raise PymlError(f"{what} need {held} but {binary_size(available)} of memory is left: "
                        f"{remedy}put fewer rows through at a time (a smaller --batch with a "
                        "larger --accumulate) or train a shorter --seq")
    if say:
        print(f"memory: {what} hold {held}")


def resumed_spec(checkpoint: Path, recorded: dict) -> Path:
    """The spec a resume without --spec or --init trains: the one the checkpoint holds, or for a
    LoRA checkpoint (an adapter folder) its base's, the --init folder it recorded."""
    from pyml.packages import spec_file

    if (checkpoint / SPEC_FILE).is_file():
        return checkpoint / SPEC_FILE
    if recorded.get("init") is None:
        raise PymlError(f"{checkpoint} holds no {SPEC_FILE} and names no --init: give --spec")
    return spec_file(Path(recorded["init"]))


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


def say_dense_copy(init: Path, dtype: str, what: str, note: str = "") -> None:
    """Say on stderr when training makes a `dtype` copy of `what` from an --init folder that
    stores them otherwise (quantized, bf16, f16: smaller), and how big: the copy, not the file,
    is what the run holds in memory."""
    if not init.is_dir():
        return
    stored = StoredFolder(init)
    kind = GGMLType.F64 if np.dtype(dtype) == np.float64 else GGMLType.F32
    if all(tensor.ggml_type == kind for tensor in stored.tensors.values()):
        return
    values = sum(prod(tensor.shape) for tensor in stored.tensors.values())
    print(f"pyml: making a {np.dtype(dtype).name} copy of {what}: "
          f"{size_text(values * np.dtype(dtype).itemsize)} in memory, from {stored.describe()}{note}",
          file=sys.stderr)


def say_stored_base(model, init: Path) -> None:
    """Say on stderr, for a LoRA run over a base folder, that its linear maps are read where the
    folder stores them (QLoRA) and what the float copies of the rest (the embedding, norms) cost."""
    maps = model.stored_maps
    if maps is None:
        return
    formats = sorted({part for text in maps.formats.values() for part in text.split("/")})
    dense = model.Parameters.FROZEN_SIZE * model.device.dtype.itemsize
    print(f"pyml: LoRA over the base as stored: {StoredFolder(init).describe()}, its linear maps "
          f"({'/'.join(formats)}) read in place; the embedding and norms as "
          f"{model.device.dtype.name}: {size_text(dense)}", file=sys.stderr)


def digits_pairs(config: TrainingConfig, package: ModuleType):
    """Train and held-out (images, labels) of the digits data set, checked against the spec."""
    from pyml.train.digits import CLASSES, PIXELS, load_digits_split

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
    """Train and held-out (input ids, target ids) of --data as the `--init` folder tokenises it:
    text documents split by document and packed into windows of `config.seq` tokens, or JSONL
    examples one per row, held out by example or from --eval-data."""
    spec_model = package.model
    if config.init is None:
        raise PymlError(
            "decoders need --init: a model folder (from `pyml import-gguf`) whose tokenizer.json "
            "tokenises the training text and whose weights (source.gguf, model.safetensors) are the "
            "starting weights; "
            "a decoder of your own from fresh weights trains from Python (pyml.compile(SPEC), "
            "then Model.initialized and train_step on your token ids)"
        )
    if config.seq > spec_model.MAX_SEQ_LEN:
        raise PymlError(
            f"--seq {config.seq} exceeds spec '{config.spec}''s max_seq_len {spec_model.MAX_SEQ_LEN}"
        )
    tokens = FolderTokens(Path(config.init), spec_model.VOCAB, config.spec)
    if config.data is not None and examples.is_examples(Path(config.data)):
        return example_pairs(config, tokens)
    if config.eval_data is not None:
        raise PymlError("--eval-data holds examples (.jsonl or .json), for --data of examples, not text")
    documents = load_corpus(None if config.data is None else Path(config.data))
    train_documents, held_out_documents = split_documents(documents, seed=config.seed)
    train, held_out = (tokens.text_pairs(chosen, config.seq) for chosen in (train_documents, held_out_documents))
    print(
        f"data: {config.data or DEFAULT_CORPUS_NAME}: {len(train_documents)} train documents "
        f"({len(train[0]):,} windows), {len(held_out_documents)} held out ({len(held_out[0]):,} windows)"
    )
    return train, held_out


def example_pairs(config: TrainingConfig, tokens: FolderTokens):
    """Train and held-out (inputs, targets, positions) of JSONL examples (`pyml.train.examples`):
    packed several to a row unless --no-packing, the loss on the answers unless --train-on all."""
    train_examples = tokens.examples(Path(config.data), config.train_on)
    if config.eval_data is not None:
        held_out_examples = tokens.examples(Path(config.eval_data), config.train_on)
    else:
        train_examples, held_out_examples = examples.split_examples(train_examples, 0.1, config.seed)
    packing = config.packing is not False
    train_rows, held_out_rows = (tokens.example_rows(chosen, config.seq, config.long_examples, packing)
                                 for chosen in (train_examples, held_out_examples))
    print(
        f"data: {config.data}: {train_rows.examples} train examples ({train_rows.target_count:,} "
        f"target tokens) in {len(train_rows.inputs)} rows, {held_out_rows.examples} held out "
        f"({held_out_rows.target_count:,}) in {len(held_out_rows.inputs)}"
        f"{', packed' if packing else ''}; {train_rows.truncated} truncated to --seq {config.seq}, "
        f"{train_rows.dropped} dropped (--long-examples {config.long_examples or 'truncate'})"
    )
    return ((train_rows.inputs, train_rows.targets, train_rows.positions),
            (held_out_rows.inputs, held_out_rows.targets, held_out_rows.positions))


def preference_pairs(config: TrainingConfig, package: ModuleType, model, objective, out: Path,
                     resume: bool, is_root: bool):
    """Train and held-out pairs of --data (`pyml.train.preference`), as aligned arrays for the
    loop, held out by pair or from --eval-data; for DPO with the reference log-probabilities of
    the model as it is before the first step, computed now and kept in the run folder
    (`REFERENCE_FILE`, by the root rank: every rank computes the same), or on a resume read from
    there."""
    from pyml.train.preference import REFERENCE_FILE, load_pairs, pair_rows, with_reference

    spec_model = package.model
    if config.init is None or config.data is None or not examples.is_examples(Path(config.data)):
        raise PymlError(f"--method {config.method} trains on preference pairs: give --init (a model folder) "
                        "and --data, a .jsonl or .json file of {\"prompt\", \"chosen\", \"rejected\"}")
    if config.seq > spec_model.MAX_SEQ_LEN:
        raise PymlError(f"--seq {config.seq} exceeds spec '{config.spec}''s max_seq_len {spec_model.MAX_SEQ_LEN}")
    tokens = FolderTokens(Path(config.init), spec_model.VOCAB, config.spec)
    train, skips = load_pairs(Path(config.data), tokens)
    if config.eval_data is not None:
        held_out, held_out_skips = load_pairs(Path(config.eval_data), tokens)
        skips += held_out_skips
    else:
        train, held_out = examples.split_examples(train, 0.1, config.seed)
    (train_rows, too_long), (held_out_rows, held_out_too_long) = (
        pair_rows(chosen, config.seq, tokens.pad_id) for chosen in (train, held_out))
    for rows, where in ((train_rows, config.data), (held_out_rows, config.eval_data or config.data)):
        if not rows.pairs:
            raise PymlError(f"{where}: no pair fits --seq {config.seq} (prompt and longer answer): "
                            "use a longer --seq")
    if is_root:
        print(f"data: {config.data}: {train_rows.pairs} train pairs, {held_out_rows.pairs} held out; "
              f"{skips.describe(too_long + held_out_too_long)}")
    if objective.uses_reference:
        reference_path = out / REFERENCE_FILE
        if resume:
            train_rows, held_out_rows = read_reference(reference_path, train_rows, held_out_rows)
        else:
            score = model.target_log_probs
            train_rows, held_out_rows = (with_reference(rows, score, config.batch)
                                         for rows in (train_rows, held_out_rows))
            if is_root:
                write_reference(reference_path, train_rows, held_out_rows)
    return train_rows.arrays(), held_out_rows.arrays()


def write_reference(path: Path, train_rows, held_out_rows) -> None:
    import io

    from pyml.outputs import write_bytes

    buffer = io.BytesIO()
    np.savez(buffer, train_chosen=train_rows.reference_chosen, train_rejected=train_rows.reference_rejected,
             held_out_chosen=held_out_rows.reference_chosen, held_out_rejected=held_out_rows.reference_rejected)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, buffer.getvalue())


def read_reference(path: Path, train_rows, held_out_rows):
    """The rows with the reference log-probabilities the run computed before its first step."""
    if not path.is_file():
        raise PymlError(f"{path}: missing; a DPO run keeps its reference log-probabilities there, and "
                        "a resume needs them (start a new --out)")
    with np.load(path) as stored:
        values = {name: stored[name] for name in stored.files}
    if (len(values["train_chosen"]), len(values["held_out_chosen"])) != (train_rows.pairs, held_out_rows.pairs):
        raise PymlError(f"{path}: holds the reference of other pairs than --data's; resume on the same data")
    return (dataclasses.replace(train_rows, reference_chosen=values["train_chosen"],
                                reference_rejected=values["train_rejected"]),
            dataclasses.replace(held_out_rows, reference_chosen=values["held_out_chosen"],
                                reference_rejected=values["held_out_rejected"]))
