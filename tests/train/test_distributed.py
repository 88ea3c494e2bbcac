"""Data-parallel training under `mpiexec` on localhost, against the same training in one process:
2 ranks give one rank's losses and final weights within 1e-12 relative over 10 float64 steps (the
reduced decoder on packed rows and the digits MLP, sharded optimizer state or not, one bucket or many), repeats
are bit-identical (also with 3 ranks, where the order of a sum matters), a 2-rank checkpoint
resumes with 1 rank and with 2 (sharded too), and a fault on one rank stops every rank with one
line, a non-zero exit and the last checkpoint intact. LoRA (adapters on frozen base weights) trains on 2 ranks as
on one. The runs themselves are in tests/support/distributed_worker.py."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pyml.train.checkpoint import latest_checkpoint, list_checkpoints, read_state
from pyml.train.loop import run_training
from tests.support import anchors
from tests.support import distributed_worker as worker
from tests.support.project_packages import project_package

ROOT = Path(__file__).resolve().parents[2]
RELATIVE = 1e-12
# one thread per rank: two ranks share this machine's two cores
ONE_THREAD = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def mpiexec_program() -> str:
    """The mpiexec that `pyml train --ranks` runs (the mpich wheel's beside this Python, else
    PATH's), for ranks that import mpi4py: both come with the test extra."""
    anchors.module("mpi4py", "pip install mpi4py mpich")
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else anchors.program("mpiexec", "pip install mpich")


def mpiexec(ranks: int, plan: dict, folder: Path, timeout: float = 300):
    plan_path = folder / f"plan_{ranks}.json"
    plan_path.write_text(json.dumps(plan))
    return subprocess.run(
        [mpiexec_program(), "-n", str(ranks), sys.executable, str(ROOT / "tests" / "support" / "distributed_worker.py"),
         str(plan_path)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **ONE_THREAD},
    )  # fmt: skip


def result(run: dict) -> tuple[dict, np.ndarray]:
    out = Path(run["out"])
    return json.loads((out / "result.json").read_text()), np.load(out / "result.npy")


def one_rank(run: dict, out: Path, resume: bool = False):
    """The run in this process, without MPI: `pyml train`'s path with one rank."""
    package, model = worker.make_model(run, rank=0)
    train_pairs, held_out_pairs = worker.training_data(run, model)
    trained = run_training(package, model, train_pairs, held_out_pairs, worker.config(run), out,
                           resume=resume, progress=False, objective=worker.config(run).objective())  # fmt: skip
    return {"losses": trained.train_losses, "evaluations": trained.evaluations}, model.params.flat


def assert_close(ours, reference):
    ours, reference = np.asarray(ours), np.asarray(reference)
    scale = np.abs(reference).max()
    np.testing.assert_allclose(ours, reference, rtol=RELATIVE, atol=RELATIVE * scale)


def run(folder: Path, name: str, **options) -> dict:
    return {"out": str(folder / name), "steps": 10, **options}


DECODER = dict(model="llama_tiny", batch=3)  # 3 rows: 1 and 2 per rank, uneven on purpose
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}  # a [lora] table
MLP = dict(model="mlp_digits", batch=64)
# 13 buckets of uneven sizes, cut into pieces of at most 700 of llama_tiny's 21664 gradients,
# through 2 staging slots: the exchange's pipeline with many of everything
MANY = dict(buckets=13, piece_elements=700, staging_slots=2)


def lora_base(folder: Path) -> str:
    """The frozen weights LoRA runs train adapters on: llama_tiny's, seeded, in a folder's
    model.safetensors, which each rank reads where it is stored (its linear maps' rows in place)."""
    llama = project_package("llama_tiny")

    base = folder / "base"
    base.mkdir(exist_ok=True)
    llama.Model.initialized(seed=3, dtype=np.float64).to_safetensors(base / "model.safetensors")
    return str(base)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two_ranks")
    runs = {
        "lora": run(folder, "lora", lora=LORA, base=lora_base(folder), **DECODER),
        "decoder": run(folder, "decoder", **DECODER),
        "decoder_again": run(folder, "decoder_again", **DECODER),
        "decoder_sharded": run(folder, "decoder_sharded", shard=True, **DECODER),
        "decoder_buckets": run(folder, "decoder_buckets", **MANY, **DECODER),
        "decoder_buckets_sharded": run(folder, "decoder_buckets_sharded", shard=True, **MANY,
                                       **DECODER),  # fmt: skip
        "mlp": run(folder, "mlp", **MLP),
        "mlp_sharded": run(folder, "mlp_sharded", shard=True, **MLP),
        # stopped at step 5 (twice: one to resume with 2 ranks here, one with 1 rank in the test)
        "first_half": run(folder, "first_half", **{**DECODER, "steps": 5}),
        "first_half_copy": run(folder, "first_half_copy", shard=True, **{**DECODER, "steps": 5}),
        "resumed": run(folder, "first_half", resume=True, **DECODER),
        # gradient accumulation: 3 rows a step in 3 slices of 1 row (each rank's 1 or 2 rows in
        # 3 slices: an empty slice on one rank), LoRA adapters, and the sharded optimizer
        "accumulated": run(folder, "accumulated", accumulate=3, **{**DECODER, "batch": 1}),
        "lora_accumulated": run(folder, "lora_accumulated", lora=LORA, base=lora_base(folder),
                                accumulate=3, shard=True, **{**DECODER, "batch": 1}),
        # the same with the optimizer state sharded: saved gathered, resumed scattered again
        "sharded_first_half": run(folder, "sharded_first_half", shard=True, **{**DECODER, "steps": 5}),
        "sharded_resumed": run(folder, "sharded_first_half", shard=True, resume=True, **DECODER),
    }
    job = mpiexec(2, {"runs": list(runs.values())}, folder)
    assert job.returncode == 0, job.stderr
    return folder, runs, job


@pytest.fixture(scope="module")
def references(two_ranks, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_rank")
    _, runs, _ = two_ranks
    return {name: one_rank(runs[name], folder / name) for name in ("decoder", "mlp", "lora")}


def test_accumulated_steps_on_two_ranks_are_the_large_batch_on_one(two_ranks, references):
    """--accumulate 3 of --batch 1 is --batch 3: the losses and weights of one rank's unaccumulated
    run, with LoRA and a sharded optimizer too."""
    _, runs, _ = two_ranks
    for name, reference in (("accumulated", "decoder"), ("lora_accumulated", "lora")):
        ours, weights = result(runs[name])
        theirs, reference_weights = references[reference]
        assert_close(ours["losses"], theirs["losses"])
        assert_close(weights, reference_weights)


@pytest.mark.parametrize("name, reference", [
    ("decoder", "decoder"), ("decoder_sharded", "decoder"), ("decoder_buckets", "decoder"),
    ("decoder_buckets_sharded", "decoder"), ("mlp", "mlp"), ("mlp_sharded", "mlp"),
    ("lora", "lora"),
])  # fmt: skip
def test_two_ranks_train_as_one_rank(two_ranks, references, name, reference):
    _, runs, _ = two_ranks
    ours, weights = result(runs[name])
    theirs, reference_weights = references[reference]
    assert len(ours["losses"]) == 10
    assert_close(ours["losses"], theirs["losses"])
    assert_close([e["loss"] for e in ours["evaluations"]], [e["loss"] for e in theirs["evaluations"]])
    assert_close(weights, reference_weights)
    assert not np.array_equal(weights, worker.make_model(runs[name], 0)[1].params.flat)  # it trained


@pytest.fixture(scope="module")
def preference_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preference_ranks")
    runs = {
        "dpo": run(folder, "dpo", method="dpo", **DECODER),  # 3 pairs: 1 and 2 per rank
        # 3 pairs a step in 3 slices of 1, ORPO's cross-entropy the mean over all the chosen tokens
        "orpo_accumulated": run(folder, "orpo_accumulated", method="orpo", accumulate=3, shard=True,
                                **{**DECODER, "batch": 1}),
    }
    job = mpiexec(2, {"runs": list(runs.values())}, folder)
    assert job.returncode == 0, job.stderr
    return runs


@pytest.mark.parametrize("name, reference", [("dpo", None), ("orpo_accumulated", {"accumulate": 1, "batch": 3})])
def test_preference_pairs_on_two_ranks_train_as_one_rank(preference_ranks, tmp_path, name, reference):
    """DPO's and ORPO's step on two ranks (each its share of the pairs, weighted for the whole
    batch) is one rank's; ORPO's accumulated over 3 slices is one rank's unaccumulated step."""
    ours, weights = result(preference_ranks[name])
    theirs, reference_weights = one_rank({**preference_ranks[name], **(reference or {})}, tmp_path / name)
    assert len(ours["losses"]) == 10
    assert_close(ours["losses"], theirs["losses"])
    for metric in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert_close([e[metric] for e in ours["evaluations"]], [e[metric] for e in theirs["evaluations"]])
    assert_close(weights, reference_weights)
    assert not np.array_equal(weights, worker.make_model(preference_ranks[name], 0)[1].params.flat)


def test_two_runs_with_two_ranks_are_bit_identical(two_ranks):
    _, runs, _ = two_ranks
    (first, first_weights), (second, second_weights) = result(runs["decoder"]), result(
        runs["decoder_again"]
    )
    assert first["losses"] == second["losses"]  # exact float equality
    assert np.array_equal(first_weights, second_weights)


def test_the_exchange_starts_before_the_backward_ends(two_ranks):
    """With many buckets, reductions start while later buckets are still to come."""
    _, runs, _ = two_ranks
    started = result(runs["decoder_buckets"])[0]["started_when_reported"]
    buckets = MANY["buckets"]
    per_step = [started[i : i + buckets] for i in range(0, len(started), buckets)]
    assert len(per_step) == 10
    assert all(step[0] == 0 and step[-1] > 0 for step in per_step)


def test_a_two_rank_checkpoint_resumes_with_two_ranks_and_with_one(two_ranks, references, tmp_path):
    folder, runs, _ = two_ranks
    straight, straight_weights = result(runs["decoder"])
    resumed, resumed_weights = result(runs["resumed"])
    assert resumed["losses"] == straight["losses"]  # 2 -> 2: bit for bit
    assert np.array_equal(resumed_weights, straight_weights)

    # 2 -> 1, from the checkpoint a sharded 2-rank run wrote at step 5
    shutil.copytree(folder / "first_half_copy", tmp_path / "run")
    assert read_state(latest_checkpoint(tmp_path / "run"))["step"] == 5
    one, one_weights = one_rank(runs["decoder"], tmp_path / "run", resume=True)
    # carried over from the checkpoint (sharded: its clipping norm sums the squares in another
    # order than the unsharded run's, so the losses agree to rounding, not bit for bit)
    assert_close(one["losses"][:5], straight["losses"][:5])
    assert_close(one["losses"], references["decoder"][0]["losses"])
    assert_close(one_weights, references["decoder"][1])
    assert_close(one_weights, straight_weights)


def test_a_sharded_two_rank_run_resumed_on_two_ranks_continues_bit_for_bit(two_ranks):
    """Each rank's slice of the AdamW moments goes into the checkpoint gathered whole and comes
    back scattered to its rank: the resumed run is the uninterrupted sharded run, bit for bit."""
    _, runs, _ = two_ranks
    straight, straight_weights = result(runs["decoder_sharded"])
    resumed, resumed_weights = result(runs["sharded_resumed"])
    assert resumed["losses"] == straight["losses"]
    assert np.array_equal(resumed_weights, straight_weights)


def test_three_ranks_repeat_bit_for_bit(tmp_path, references):
    runs = [run(tmp_path, name, **DECODER) for name in ("first", "second")]
    job = mpiexec(3, {"runs": runs}, tmp_path)
    assert job.returncode == 0, job.stderr
    (first, first_weights), (second, second_weights) = (result(r) for r in runs)
    assert first["losses"] == second["losses"]
    assert np.array_equal(first_weights, second_weights)
    assert_close(first["losses"], references["decoder"][0]["losses"])
    assert_close(first_weights, references["decoder"][1])


@pytest.mark.parametrize("fault, message", [
    (dict(kind="nan", rank=1, step=5),
     r"error: training stopped at step 5: rank 1: non-finite loss \(nan\) at optimizer step 5; "
     r"weights left unchanged; the last good checkpoint, .*step_000004, is kept"),
    (dict(kind="bad_data", rank=1, step=5),
     r"error: training stopped at step 5: rank 1: targets hold ids outside \[0, 96\)"),
    (dict(kind="hang", rank=1, step=5),
     r"error: rank 1 sent nothing at step 5 within 3 s: it died or hangs; stopping every rank"),
    (dict(kind="save_raises", rank=0, step=5),
     r"error: rank 0: RuntimeError: injected while writing the checkpoint; stopping every rank"),
])  # fmt: skip
def test_a_fault_on_one_rank_stops_every_rank_with_one_line(tmp_path, fault, message):
    plan = {"runs": [run(tmp_path, "run", fault=fault, checkpoint_every=2, **DECODER)],
            "peer_timeout": 3}  # fmt: skip
    job = mpiexec(2, plan, tmp_path, timeout=120)  # a hang would exceed it
    assert job.returncode == 2
    # MPI_Abort's own line ("Abort(2) on node 1 (rank 1 ...") comes from MPICH, not from pyml
    lines = [line for line in job.stderr.splitlines() if line.strip() and
             not line.startswith("Abort(")]  # fmt: skip
    if fault["kind"] == "save_raises":
        # an unexpected exception: its traceback and the line, which the ranks' interleaved
        # stderr may put in any order
        lines = [line for line in lines if line.startswith("error:")]
    assert len(lines) == 1, job.stderr
    assert re.fullmatch(message + ".*", lines[0]), lines[0]
    assert_last_checkpoint_is_step_4(tmp_path / "run")


def test_a_rank_that_dies_ends_the_job(tmp_path):
    fault = dict(kind="kill", rank=1, step=5)
    job = mpiexec(2, {"runs": [run(tmp_path, "run", fault=fault, checkpoint_every=2, **DECODER)]},
                  tmp_path, timeout=120)  # fmt: skip
    assert job.returncode != 0
    assert "signal 9" in job.stdout + job.stderr  # the MPI launcher says which process died
    assert_last_checkpoint_is_step_4(tmp_path / "run")


def assert_last_checkpoint_is_step_4(out: Path):
    """Every checkpoint is kept (`--keep` left out): steps 2 and 4, none after the fault."""
    assert [p.name for p in list_checkpoints(out)] == ["step_000002", "step_000004"]
    state = read_state(out / "step_000004")
    assert state["step"] == 4 and len(state["train_losses"]) == 4
    assert all(np.isfinite(state["train_losses"]))


def test_sigterm_on_the_launcher_saves_once_and_stops_every_rank(tmp_path):
    mpiexec_program()  # --ranks finds it the same way
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pyml.cli", "train", "--spec", str(ROOT / "specs/mlp_digits.toml"),
         "--ranks", "2", "--steps", "1000000", "--checkpoint-every", "10", "--eval-every",
         "1000000", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while latest_checkpoint(out) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 143, stderr  # 128 + SIGTERM: saved, but stopped early
    assert stdout.count("SIGTERM: saving a checkpoint after this step") == 1  # rank 0 alone
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1
    step = int(stopped[0].split("after step ")[1])
    # the periodic checkpoints, then the one saved on SIGTERM, once
    assert [p.name for p in list_checkpoints(out)] == [
        f"step_{saved:06d}" for saved in [*range(10, step, 10), step]]
    assert read_state(latest_checkpoint(out))["step"] == step > 10


def test_one_rank_imports_no_mpi(tmp_path):
    code = (
        "import sys; from pathlib import Path; from pyml.train.run import train; "
        f"train(Path({str(ROOT / 'specs/mlp_digits.toml')!r}), steps=2, out=Path({str(tmp_path)!r}), "
        "progress=False); assert 'mpi4py' not in sys.modules, 'mpi4py was imported'"
    )
    job = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
