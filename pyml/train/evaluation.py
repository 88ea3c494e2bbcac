"""The held-out evaluation of a training run, and `pyml eval`: the mean loss (and a classifier's
accuracy) over held-out rows, in float64 numpy from the model's logits, with the training's
masking rules (only counted targets: for JSONL chats, the answers)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.package.base import IGNORED_TARGET
from pyml.train.config import TrainingConfig


def evaluate(model, held_out_pairs: tuple[np.ndarray, ...], config: TrainingConfig) -> dict:
    """Mean held-out cross-entropy over a fixed set of held-out rows, from forward passes only
    (the gradients are left alone); classifiers also get their accuracy. Decoders use the first
    `eval_batches` batches of the held-out sequences, classifiers every held-out example. The
    pairs' third array, where there is one, holds packed JSONL rows' positions."""
    inputs, targets, *packed = held_out_pairs
    if config.seq is None:
        batch_size, batch_count = len(inputs), 1
    else:
        batch_size = min(config.batch, len(inputs))
        batch_count = min(config.eval_batches, len(inputs) // batch_size)
    rows = slice(0, batch_count * batch_size)
    loss_sum, counted, correct = loss_over(model, inputs[rows], targets[rows], batch_size,
                                           packed[0][rows] if packed else None)
    evaluation = {"loss": loss_sum / counted}
    if config.seq is None:
        evaluation["accuracy"] = correct / counted
    return evaluation


def loss_over(model, inputs: np.ndarray, targets: np.ndarray, batch_size: int,
              positions: np.ndarray | None = None) -> tuple[float, int, int]:
    """(summed cross-entropy, targets counted, argmax hits) over every row, `batch_size` rows at
    a time: what a run's held-out evaluation and `pyml eval` report. A decoder's `positions` say
    where the examples packed in its rows start."""
    loss_sum, counted, correct = 0.0, 0, 0
    for start in range(0, len(inputs), batch_size):
        rows = slice(start, start + batch_size)
        packed = {} if positions is None else {"positions": positions[rows]}
        batch_loss_sum, batch_counted, batch_correct = cross_entropy_sum(
            model.forward(inputs[rows], **packed), targets[rows]
        )
        loss_sum, counted, correct = (
            loss_sum + batch_loss_sum, counted + batch_counted, correct + batch_correct
        )  # fmt: skip
    return loss_sum, counted, correct


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
    if "rewards/accuracies" in evaluation:
        text += (f", reward accuracy {evaluation['rewards/accuracies']:.4f}, "
                 f"margin {evaluation['rewards/margins']:.4f}")
    return text


def evaluate_folder(model_dir: Path, data: Path, adapter: Path | None = None, seq: int = 128,
                    batch: int = 2, train_on: str | None = None, long_examples: str | None = None,
                    dtype: str = "float32") -> dict:
    """`pyml eval`: the loss and perplexity of the model in `model_dir` (with a LoRA `adapter`
    beside its weights) on every row of `data` (text windows of `seq` tokens, or JSONL examples),
    counted as training counts its targets. In float32 the logits come from the decode step on the
    weights as the folder stores them, an adapter's updates beside them (no float32 copy: an 8B
    GGUF scores in its file's memory); in float64 from a float64 copy, the adapter folded in."""
    from pyml.generate.decoding import load_decoder, load_model
    from pyml.train import examples
    from pyml.train.data import load_corpus
    from pyml.train.folder_data import FolderTokens

    if seq < 1 or batch < 1:
        raise PymlError("--seq and --batch must be at least 1")
    if dtype not in ("float32", "float64"):
        raise PymlError(f"--dtype must be float32 or float64, got {dtype}")
    if dtype == "float32":  # the weights as stored, through the decode step
        scorer = load_decoder(Path(model_dir), adapter=adapter)
        model = scorer.model
    else:  # a float64 model, the adapters folded in
        scorer = model = load_model(Path(model_dir), adapter=adapter, dtype=np.dtype(dtype))
    if seq > model.MAX_SEQ_LEN:
        raise PymlError(f"--seq {seq} exceeds the model's max_seq_len {model.MAX_SEQ_LEN}")
    tokens = FolderTokens(Path(model_dir), model.VOCAB, model.SPEC_NAME)
    positions, counts = None, {}
    if examples.is_examples(Path(data)):  # packed as training packs them
        rows = tokens.example_rows(tokens.examples(Path(data), train_on), seq, long_examples, True)
        inputs, targets, positions = rows.inputs, rows.targets, rows.positions
        counts = {"examples": rows.examples}
    else:
        inputs, targets = tokens.text_pairs(load_corpus(Path(data)), seq)
    loss_sum, counted, _ = loss_over(scorer, inputs, targets, batch, positions)
    loss = loss_sum / counted
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": counted, "rows": len(inputs), **counts}


def logit_scorer(model):
    """(input ids, targets) -> each target's log-probability (B, T) float64, 0 where no target,
    from `model.forward`'s logits (any model `pyml eval` loads; the float64 log-softmax in numpy,
    as `cross_entropy_sum` takes it)."""

    def score(inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        logits = np.asarray(model.forward(inputs), dtype=np.float64)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_normalisers = np.log(np.exp(shifted).sum(axis=-1))
        has_target = targets != IGNORED_TARGET
        picked = np.take_along_axis(shifted, np.where(has_target, targets, 0)[..., None], axis=-1)[..., 0]
        return np.where(has_target, picked - log_normalisers, 0.0)

    return score


def evaluate_pairs_folder(model_dir: Path, data: Path, objective, adapter: Path | None = None,
                          reference: Path | None = None, seq: int = 128, batch: int = 2,
                          dtype: str = "float32") -> dict:
    """`pyml eval --method dpo|orpo`: the preference loss and TRL's metrics of the model in
    `model_dir` (with a LoRA `adapter`) on every pair of `data` that fits `seq`. DPO's reference
    is the base without the adapter, or the `reference` model folder (the model the run started
    from) for a fully fine-tuned model."""
    from pyml.generate.decoding import load_decoder, load_model
    from pyml.train.folder_data import FolderTokens
    from pyml.train.preference import evaluate_pairs, load_pairs, pair_rows, with_reference

    if seq < 1 or batch < 1:
        raise PymlError("--seq and --batch must be at least 1")
    if dtype not in ("float32", "float64"):
        raise PymlError(f"--dtype must be float32 or float64, got {dtype}")
    if objective.uses_reference and adapter is None and reference is None:
        raise PymlError("--method dpo compares the model with its reference: give --adapter (the base "
                        "is the reference) or --reference, the model folder the run started from")
    if not objective.uses_reference and reference is not None:
        raise PymlError(f"--method {objective.method} uses no reference model: leave out --reference")

    def scorer(folder: Path, folder_adapter: Path | None):
        if dtype == "float32":  # the weights as stored, through the decode step
            decoder = load_decoder(Path(folder), adapter=folder_adapter)
            return decoder.model, logit_scorer(decoder)
        model = load_model(Path(folder), adapter=folder_adapter, dtype=np.dtype(dtype))
        return model, model.target_log_probs

    model, score = scorer(model_dir, adapter)
    if seq > model.MAX_SEQ_LEN:
        raise PymlError(f"--seq {seq} exceeds the model's max_seq_len {model.MAX_SEQ_LEN}")
    tokens = FolderTokens(Path(model_dir), model.VOCAB, model.SPEC_NAME)
    pairs, skips = load_pairs(Path(data), tokens)
    rows, too_long = pair_rows(pairs, seq, tokens.pad_id)
    if not rows.pairs:
        raise PymlError(f"{data}: no pair fits --seq {seq}: use a longer --seq")
    if objective.uses_reference:
        _, reference_score = scorer(reference or model_dir, None)
        rows = with_reference(rows, reference_score, batch)
    return {**evaluate_pairs(score, rows, objective, batch), "pairs": rows.pairs,
            "skipped": skips.describe(too_long)}
