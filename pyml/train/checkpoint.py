"""Training checkpoints: one folder per saved step, written whole or not at all.

`out/step_000200/` is a model folder (`pyml.formats.model_folder`: model.safetensors, spec.toml
and, for a model trained from an imported one, its config.json, tokenizer and chat template), so
`pyml generate`, `pyml export-gguf` and transformers read it as they read an imported model.
Beside those it holds optimizer.safetensors (AdamW's exp_avg and exp_avg_sq as flat 1-D tensors)
and state.json (the step, the optimizer's step count, the parameter layout those flat tensors
follow, the data position and generator state, the losses so far and the run's configuration). A
checkpoint is written into a hidden temporary folder and renamed into place, so any `step_*`
folder is complete; the latest is the one with the highest step. Every checkpoint is kept unless
the run's config has `keep` (`--keep N`): then, once a new one is in place, all but the N newest
are deleted, except the best (the lowest held-out loss among the checkpointed steps that were
evaluated), as transformers' `save_total_limit` with `load_best_model_at_end` keeps it. So a crash
never leaves a run without its latest checkpoint, and the latest and the best are never deleted.

The checkpoint of a LoRA model (one with frozen base weights) is a `peft` adapter folder instead
(`pyml.train.lora`: adapter_config.json, adapter_model.safetensors, the tokenizer) beside the
same optimizer.safetensors, which then holds the adapters' AdamW state, and state.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.model_folder import MODEL_FILE, STATE_FILE, write_model_folder
from pyml.formats.safetensors_io import read_safetensors, write_safetensors
from pyml.outputs import atomic_write, os_error, written_folder
from pyml.train.lora import ADAPTER_MODEL_FILE, read_adapter_tensors, write_adapter_folder
from pyml.train.loss_curve import LOSS_CURVE_FILE
from pyml.train.metrics import EVENTS_FOLDER, METRICS_FILE
from pyml.train.preference import REFERENCE_FILE

CHECKPOINT_PREFIX = "step_"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_TENSORS = ("exp_avg", "exp_avg_sq")


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in `out`, oldest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = []
    for path in out.iterdir():
        step = path.name.removeprefix(CHECKPOINT_PREFIX)
        if path.name.startswith(CHECKPOINT_PREFIX) and step.isdigit() and path.is_dir():
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def is_run_folder(path: Path) -> bool:
    """Whether `path` is an empty folder or one a training run writes: its checkpoints, its loss
    curve, its metrics (and their TensorBoard events) and their temporaries, nothing else (where
    `pyml train --out` may start or continue)."""
    if not Path(path).is_dir():
        return False
    written = (LOSS_CURVE_FILE, METRICS_FILE, EVENTS_FOLDER, REFERENCE_FILE)
    return all(child.name.startswith((CHECKPOINT_PREFIX, ".")) or child.name in written
               for child in Path(path).iterdir())


def latest_checkpoint(out: Path) -> Path | None:
    checkpoints = list_checkpoints(out)
    return checkpoints[-1] if checkpoints else None


def refuse_used_run_folder(out: Path) -> None:
    """A fresh run (no --resume) into a folder that holds a checkpoint would mix two runs."""
    checkpoint = latest_checkpoint(out)
    if checkpoint is not None:
        raise PymlError(
            f"{out} already holds a checkpoint ({checkpoint.name}): pass --resume to continue "
            "that run, or choose another --out"
        )


def save_checkpoint(
    out: Path, model, optimizer, state: dict, model_files: dict[str, bytes] | None = None
) -> Path:
    """Write the checkpoint of `state["step"]` into `out` and return its folder; then, if the run's
    config has `keep`, delete the checkpoints it does not keep (`checkpoints_to_delete`). `model_files` (name -> content) are the model folder's files beside the
    weights (`model_folder.folder_files`, or `lora.adapter_files` for a LoRA model). A checkpoint already saved for that step is kept as it
    is (the same run at the same step has the same weights, optimizer state and data position)."""
    out = Path(out)
    final = out / checkpoint_name(state["step"])
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not final.is_dir():
            with written_folder(final) as temporary:
                if is_lora(model):
                    write_adapter_folder(temporary, model, model_files or {})
                else:
                    write_model_folder(temporary, model, model_files or {})
                optimizer_state = optimizer.state()
                write_safetensors(
                    temporary / OPTIMIZER_FILE,
                    {name: np.ascontiguousarray(optimizer_state[name]) for name in OPTIMIZER_TENSORS},
                )
                write_json(
                    temporary / STATE_FILE,
                    {**state, "optimizer_step_count": optimizer.step_count,
                     "parameter_layout": model.params.LAYOUT},
                )
        # a state without the run's config (a caller of its own) keeps every checkpoint
        keep = state.get("config", {}).get("keep")
        for unkept in checkpoints_to_delete(list_checkpoints(out), keep, state.get("evaluations", [])):
            shutil.rmtree(unkept)
    except OSError as error:
        raise PymlError(f"{final}: cannot write the checkpoint: {os_error(error)}") from None
    return final


def checkpoints_to_delete(checkpoints: list[Path], keep: int | None,
                          evaluations: list[dict]) -> list[Path]:
    """Of `checkpoints` (oldest first), those that `--keep keep` does not keep: all but the `keep`
    newest and the best, the one whose step has the lowest held-out loss. None keeps all."""
    if keep is None:
        return []
    held_out_loss = {evaluation["step"]: evaluation["loss"] for evaluation in evaluations}
    evaluated = [path for path in checkpoints if checkpoint_step(path) in held_out_loss]
    best = min(evaluated, key=lambda path: held_out_loss[checkpoint_step(path)], default=None)
    return [path for path in checkpoints[:-keep] if path != best]


def checkpoint_step(checkpoint: Path) -> int:
    return int(Path(checkpoint).name.removeprefix(CHECKPOINT_PREFIX))


def is_lora(model) -> bool:
    """Whether `model` trains adapters on frozen base weights (its spec has a [lora] table)."""
    return model.FROZEN_TENSOR_TABLE is not None


def read_state(checkpoint: Path) -> dict:
    path = Path(checkpoint) / STATE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PymlError(f"{path}: cannot read the checkpoint state: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise PymlError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})") from None


def load_checkpoint(checkpoint: Path, model, optimizer) -> dict:
    """Load the weights (a LoRA model's adapters) and optimizer state of `checkpoint` into `model`
    and `optimizer`; return its state."""
    checkpoint = Path(checkpoint)
    state = read_state(checkpoint)
    if is_lora(model):
        model.load_adapter_tensors(read_adapter_tensors(checkpoint),
                                   str(checkpoint / ADAPTER_MODEL_FILE))
    else:
        model.load_tensors(read_safetensors(checkpoint / MODEL_FILE), str(checkpoint / MODEL_FILE))
    if state.get("parameter_layout") != model.params.LAYOUT:
        raise PymlError(
            f"{checkpoint}: its optimizer state is laid out for other parameters "
            f"({state.get('parameter_layout', 'a layout older pyml did not record')}; this model: "
            f"{model.params.LAYOUT}); start a new run from its {MODEL_FILE} instead"
        )
    tensors = read_safetensors(checkpoint / OPTIMIZER_FILE)
    expected_shape = (model.params.flat.shape[0],)
    for name in OPTIMIZER_TENSORS:
        if name not in tensors or tensors[name].shape != expected_shape:
            raise PymlError(
                f"{checkpoint / OPTIMIZER_FILE}: expected tensor {name} of shape {expected_shape}, "
                f"found {tensors[name].shape if name in tensors else 'none'}"
            )
    optimizer.load_state(
        {name: tensors[name].astype(model.device.dtype, copy=False) for name in OPTIMIZER_TENSORS},
        state["optimizer_step_count"],
    )
    return state


def write_json(path: Path, value: dict) -> None:
    """Write `value` as JSON atomically: readers see the old file or the whole new one."""
    content = (json.dumps(value, indent=1) + "\n").encode("utf-8")
    atomic_write(Path(path), lambda handle: handle.write(content))
