"""Training runs for tests/train/test_distributed.py, one MPI job for a whole plan of them:

    mpiexec -n N python tests/support/distributed_worker.py PLAN.json

PLAN.json holds {"runs": [run, ...]}; each run trains from fresh weights into run["out"] with
`run_training`, as `pyml train` would on every rank, and rank 0 writes what it computed to
run["out"]/result.json (losses, evaluations) and result.npy (the final flat weights). A run may
ask for a test double (`buckets`: a backward that reports that many buckets; `fault`: a failure
injected on one rank). The test imports this module for the same data and models with one rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pyml.errors import PymlError  # noqa: E402
from pyml.package.base import IGNORED_TARGET  # noqa: E402
from pyml.train import gradient_exchange  # noqa: E402
from pyml.train.config import TrainingConfig  # noqa: E402
from pyml.train.data import encode_documents, load_corpus, next_token_pairs, pack, split_documents  # noqa: E402
from pyml.train.digits import load_digits_split  # noqa: E402
from pyml.train.distributed import process_group  # noqa: E402
from pyml.train.loop import run_training  # noqa: E402
from tests.support.project_packages import project_package  # noqa: E402

SEQ = 16


def decoder_pairs():
    """pydoc_data folded into llama_tiny's 96 ids (as tests/train/test_train.py), with some targets
    ignored: a scattered fifth of them, and every fifth row entirely, so that the ranks' slices of
    a batch count different numbers of targets, sometimes none. The training rows are packed: a
    second example starts at a random place of most rows (their `positions` restart there)."""
    llama = project_package("llama_tiny")

    train_documents, held_out_documents = split_documents(load_corpus(None)[:12], seed=0)

    def folded_bytes(texts):
        return [[byte % llama.model.VOCAB for byte in text.encode("utf-8")] for text in texts]

    (train_inputs, train_targets), held_out = (
        next_token_pairs(pack(encode_documents(documents, folded_bytes, llama.model.VOCAB - 1), SEQ))
        for documents in (train_documents, held_out_documents)
    )
    train_targets = train_targets.copy()
    train_targets[np.random.default_rng(1).random(train_targets.shape) < 0.2] = IGNORED_TARGET
    train_targets[::5] = IGNORED_TARGET
    positions = np.tile(np.arange(SEQ), (len(train_inputs), 1))
    for row, start in enumerate(np.random.default_rng(2).integers(0, SEQ, len(positions))):
        positions[row, start:] = np.arange(SEQ - start)
    return (train_inputs, train_targets, positions), held_out


def preference_data(run, model):
    """Preference pairs of random llama_tiny ids (run["method"]: dpo or orpo), 10 to train on and 4
    held out; for DPO with `model`'s log-probabilities as the reference (the model before step 1)."""
    from pyml.train.preference import Pair, pair_rows, with_reference

    rng = np.random.default_rng(4)
    vocab = project_package("llama_tiny").model.VOCAB

    def ids(low, high):
        return rng.integers(0, vocab, rng.integers(low, high)).tolist()

    rows, _ = pair_rows([Pair(f"pair {index}", ids(3, 8), ids(2, 6), ids(2, 6)) for index in range(14)], SEQ, 0)
    if run["method"] == "dpo":
        rows = with_reference(rows, model.target_log_probs, 4)
    return rows.take(range(10)).arrays(), rows.take(range(10, 14)).arrays()


def training_data(run, model=None):
    if run.get("method"):
        return preference_data(run, model)
    if run["model"] == "llama_tiny":
        return decoder_pairs()
    return load_digits_split(seed=0)


def config(run) -> TrainingConfig:
    decoder = run["model"] == "llama_tiny"
    return TrainingConfig(
        spec=run["model"], steps=run["steps"], batch=run["batch"], seq=SEQ if decoder else None,
        lr=3e-3 if decoder else 1e-3, weight_decay=0.01, max_grad_norm=1.0 if decoder else 0.1,
        eval_every=run.get("eval_every", 5), eval_batches=2,
        checkpoint_every=run.get("checkpoint_every", 5), seed=0, dtype="float64", device="cpu",
        lora=run.get("lora"), accumulate=run.get("accumulate", 1), method=run.get("method", "sft"),
        beta=0.1 if run.get("method") else None, loss_type="sigmoid" if run.get("method") == "dpo" else None,
    )  # fmt: skip


class ReportsBuckets:
    """A generated model whose backward reports `count` buckets of uneven sizes, from the end of
    the flat buffer back to its start (as a per-layer backward would), after computing them all:
    the exchange's handling of many buckets, ahead of a generator that reports them."""

    def __init__(self, model, count: int):
        self.model, self.started = model, []
        size = model.grads.flat.shape[0]
        edges = np.unique(np.r_[0, np.sort(np.random.default_rng(2).integers(1, size, count - 1)),
                                size])  # fmt: skip
        self.grad_buckets = [(int(a), int(b)) for a, b in zip(edges[-2::-1], edges[:0:-1])]

    def __getattr__(self, name):
        return getattr(self.model, name)

    def loss_and_grads(self, inputs, targets, on_grads_ready=None, positions=None):
        loss = self.model.loss_and_grads(inputs, targets, positions=positions)
        for index in range(len(self.grad_buckets)):
            # how many pieces the exchange had started before this report
            self.started.append(on_grads_ready.__self__.next_piece)
            on_grads_ready(index)
            np.linalg.qr(np.ones((60, 60)))  # a little work, as the next layer's backward would be
        return loss


class Faulty:
    """A generated model that fails on one rank at one step, as run["fault"] says:
    nan (a NaN weight, so a non-finite loss), bad_data (a target outside the vocabulary), hang,
    kill (SIGKILL), or save_raises (rank 0 raises while writing its weights to a checkpoint)."""

    def __init__(self, model, fault: dict, rank: int):
        self.model, self.kind, self.at_step = model, fault["kind"], fault["step"]
        self.armed = rank == fault["rank"]
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def loss_and_grads(self, inputs, targets, on_grads_ready=None, positions=None):
        self.steps += 1
        if self.armed and self.steps == self.at_step:
            if self.kind == "nan":
                self.model.params.flat[0] = np.nan
            elif self.kind == "bad_data":
                targets = np.full_like(targets, 10**6)
            elif self.kind == "hang":
                time.sleep(3600)
            elif self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return self.model.loss_and_grads(inputs, targets, on_grads_ready, positions)

    def to_safetensors(self, path):
        if self.armed and self.kind == "save_raises" and self.steps >= self.at_step:
            raise RuntimeError("injected while writing the checkpoint")
        return self.model.to_safetensors(path)


def make_model(run, rank: int):
    """A run's package and fresh model: the spec's, or with run["lora"] (a [lora] table) the
    spec's LoRA package (as `pyml train --lora-rank` generates it) on the base weights run["base"]."""

    if run.get("lora"):
        from pyml.train.lora import lora_spec

        _, package = lora_spec(ROOT / "specs" / f"{run['model']}.toml", run["lora"])
        model = package.Model.from_base(run["base"], seed=0, dtype=np.float64)
    else:
        package = project_package(run["model"])
        model = package.Model.initialized(seed=0, dtype=np.float64)
    if run.get("buckets"):
        model = ReportsBuckets(model, run["buckets"])
    if run.get("fault"):
        model = Faulty(model, run["fault"], rank)
    return package, model


def train_run(run, group, rank: int):
    package, model = make_model(run, rank)
    gradient_exchange.PIECE_ELEMENTS = run.get("piece_elements", PIECE_ELEMENTS)
    gradient_exchange.STAGING_SLOTS = run.get("staging_slots", STAGING_SLOTS)
    train_pairs, held_out_pairs = training_data(run, model)
    result = run_training(package, model, train_pairs, held_out_pairs, config(run), Path(run["out"]),
                          resume=run.get("resume", False), progress=False, group=group,
                          objective=config(run).objective())  # fmt: skip
    if group.is_root:
        out = Path(run["out"])
        np.save(out / "result.npy", model.params.flat)
        (out / "result.json").write_text(json.dumps(
            {"losses": result.train_losses, "evaluations": result.evaluations,
             "started_when_reported": getattr(model, "started", None)}))  # fmt: skip


PIECE_ELEMENTS, STAGING_SLOTS = gradient_exchange.PIECE_ELEMENTS, gradient_exchange.STAGING_SLOTS


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    rank = int(os.environ.get("PMI_RANK", "0"))
    try:
        for run in plan["runs"]:
            with process_group(run.get("shard", False), plan.get("peer_timeout")) as group:
                train_run(run, group, rank)
    except PymlError as error:  # as the CLI reports it
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1])
