"""SmolLM2-135M data-parallel training: one rank against two on this machine, what the gradient
exchange costs, how much of it the overlap hides, and a model of N machines.

Protocol: the real SmolLM2-135M-Instruct weights, the same global batches of 2 x 128 tokens of the
default corpus for every configuration, AdamW (as bench/train_step.py, with pyml train's default
clipping at norm 1.0), float32. Configurations, each in processes of its own: one rank with 2
threads (plain `pyml train`), one rank with 1 thread, and 2 ranks of 1 thread each (`mpiexec -n
2`, each rank training on 1 x 128 of every batch), without and with --shard-optimizer. Each runs
warm-up steps, then timed steps; reported per configuration (medians over the timed steps, the
slower rank's): the step, its forward and backward pass, its optimizer step (sharded: the update of
its share and the parameter all-gather), and the rest, which is waiting on the other rank (the
gradient exchange and the per-step agreement). Then the exchange alone, all buckets ready and
nothing else running (best of 3): what the reduce-scatter and all-gather of the 538 MB gradient
cost between the two ranks; the overlap hides 1 - waited / exchange alone of it. Also each rank's
peak resident memory, and every step's loss: 2 ranks must give 1 rank's losses within 1e-4
relative (float32), or the script fails. From the measured backward time, the model of N machines
on 10 and 100 Gbit/s links (ring all-reduce, 2 (N - 1) / N of the gradient sent per rank).

    python bench/scaling.py [--steps 5] [--warmup 2]
"""

from __future__ import annotations

import os

# Captured before anything imports pyml (which sets thread-pool variables on import).
START_ENVIRONMENT = dict(os.environ)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
B, T = 2, 128
LR, WEIGHT_DECAY, BETAS, EPS, MAX_GRAD_NORM = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
LOSS_AGREEMENT = 1e-4  # largest relative difference of a 2-rank step's loss to one rank's
# (name, ranks, threads per rank, sharded optimizer)
CONFIGURATIONS = [
    ("1 rank, 2 threads", 1, 2, False),
    ("1 rank, 1 thread", 1, 1, False),
    ("2 ranks x 1 thread", 2, 1, False),
    ("2 ranks x 1 thread, --shard-optimizer", 2, 1, True),
]
LINKS_GBIT = (10, 100)
MACHINES = (2, 8, 64)


class Timed:
    """A model or optimizer whose `method` is timed (`seconds`: the last call)."""

    def __init__(self, inner, method: str):
        self.inner, self.method, self.seconds = inner, method, 0.0

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.seconds = time.perf_counter() - started

        return timed


def worker(args) -> None:
    """One configuration, in this process (one of the ranks under mpiexec); rank 0 writes the
    measurements to args.out."""
    from pyml.train.distributed import process_group
    from pyml.train.loop import StopRequest

    with process_group(args.shard) as group:
        import pyml

        package = pyml.compile(ROOT / "specs" / "smollm2_135m.toml")
        from bench.train_step import corpus_batches

        model = Timed(package.Model.from_safetensors(MODEL_DIR), "loss_and_grads")
        optimizer = Timed(group.optimizer(package, model, lr=LR, betas=BETAS, eps=EPS,
                                          weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM),
                          "step")  # fmt: skip
        steps = []
        for inputs, targets in corpus_batches(args.warmup + args.steps):
            started = time.perf_counter()
            loss = group.train_step(package, model, optimizer, inputs, targets, StopRequest())
            steps.append({"loss": loss, "step_s": time.perf_counter() - started,
                          "compute_s": model.seconds, "optimizer_s": optimizer.seconds})  # fmt: skip
        rank, rows = 0, slice(0, B)
        if group.ranks > 1:
            rank = group.world.rank
            rows = slice(B * rank // group.ranks, B * (rank + 1) // group.ranks)
        forward_s = min(timed_call(lambda: model.forward(inputs[rows])) for _ in range(2))
        measured = {"steps": steps[args.warmup:], "warmup_losses": [s["loss"] for s in steps[:args.warmup]],
                    "forward_s": forward_s, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip
        if group.ranks > 1:
            exchange = group.exchange

            def exchange_alone():
                exchange.start_step([1.0 / group.ranks] * group.ranks)
                exchange.all_buckets_ready()
                exchange.finish()

            measured["exchange_alone_s"] = min(timed_call(exchange_alone) for _ in range(3))
            measured["buckets"], measured["pieces"] = len(model.grad_buckets), len(exchange.pieces)
        with tempfile.TemporaryDirectory() as folder:  # what a checkpoint adds to the peak
            group.save_checkpoint(Path(folder), model, optimizer.inner, {"step": len(steps)})
        measured["peak_rss_with_checkpoint_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        everyone = group.world.comm.gather(measured, root=0) if group.ranks > 1 else [measured]
        if group.is_root:
            Path(args.out).write_text(json.dumps({"ranks": everyone, "parameters": int(model.params.flat.shape[0])}))


def timed_call(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def run_configuration(name: str, ranks: int, threads: int, sharded: bool, args) -> dict:
    from pyml import THREAD_POOL_ENVIRONMENT

    environment = {**START_ENVIRONMENT, "NUMBA_NUM_THREADS": str(threads),
                   "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}  # fmt: skip
    # in the worker numpy loads before pyml: give it pyml's thread-pool settings from the start
    environment.update({k: v for k, v in THREAD_POOL_ENVIRONMENT.items() if k not in START_ENVIRONMENT})
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "measured.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
        command += ["--shard"] if sharded else []
        if ranks > 1:
            command = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks)] + command
        subprocess.run(command, env=environment, check=True, cwd=ROOT)
        measured = json.loads(out.read_text())
    per_rank = measured["ranks"]
    median = {key: max(statistics.median(s[key] for s in rank["steps"]) for rank in per_rank)
              for key in ("step_s", "compute_s", "optimizer_s")}  # the slower rank's
    waited = max(statistics.median(s["step_s"] - s["compute_s"] - s["optimizer_s"] for s in rank["steps"])
                 for rank in per_rank)  # fmt: skip
    result = {"name": name, "ranks": ranks, "threads": threads, "sharded": sharded,
              **{f"median_{key}": value for key, value in median.items()}, "median_waited_s": waited,
              "forward_s": max(rank["forward_s"] for rank in per_rank),
              "peak_rss_mib": [rank["peak_rss_mib"] for rank in per_rank],
              "peak_rss_with_checkpoint_mib": [rank["peak_rss_with_checkpoint_mib"] for rank in per_rank],
              "losses": per_rank[0]["warmup_losses"] + [s["loss"] for s in per_rank[0]["steps"]],
              "parameters": measured["parameters"], "per_rank": per_rank}  # fmt: skip
    if ranks > 1:
        alone = max(rank["exchange_alone_s"] for rank in per_rank)
        result.update(exchange_alone_s=alone, hidden_fraction=max(0.0, 1.0 - waited / alone),
                      buckets=per_rank[0]["buckets"], pieces=per_rank[0]["pieces"])  # fmt: skip
    print(f"{name}: median {median['step_s']:.3f} s/step", flush=True)
    return result


def machines_model(parameters: int, backward_s: float, embedding_share: float) -> list[dict]:
    """Per-rank bytes and time of a ring all-reduce of the float32 gradient on N machines, and how
    much of it a backward of `backward_s` can hide when buckets are reduced as they finish: all
    but the last bucket (the tied embedding, final only when the backward ends)."""
    gradient_bytes = 4 * parameters
    rows = []
    for machines in MACHINES:
        sent = 2 * (machines - 1) / machines * gradient_bytes
        for gbit in LINKS_GBIT:
            seconds = sent / (gbit * 1e9 / 8)
            hideable = min(seconds * (1 - embedding_share), backward_s)
            rows.append({"machines": machines, "link_gbit": gbit, "sent_mb": sent / 1e6,
                         "allreduce_s": seconds, "hidden_s": hideable, "exposed_s": seconds - hideable})  # fmt: skip
    return rows


def markdown(report: dict) -> str:
    lines = [f"SmolLM2-135M data-parallel training, global batch {B}x{T}, AdamW, float32, "
             f"{report['date']}, {report['machine']}, load average {report['load_average']:.1f} at the start. Medians over "
             f"{report['steps']} timed steps (the slower rank's).", "",
             "| configuration | s/step | forward+backward | optimizer | waiting on the other rank | exchange alone | overlap hides | peak RSS MiB per rank | with a checkpoint |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in report["configurations"]:
        exchange = (f"{r['exchange_alone_s']:.3f} | {100 * r['hidden_fraction']:.0f}%"
                    if r["ranks"] > 1 else "- | -")
        lines.append(f"| {r['name']} | {r['median_step_s']:.3f} | {r['median_compute_s']:.3f} | "
                     f"{r['median_optimizer_s']:.3f} | {r['median_waited_s']:.3f} | {exchange} | "
                     f"{', '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} | "
                     f"{', '.join(f'{m:.0f}' for m in r['peak_rss_with_checkpoint_mib'])} |")  # fmt: skip
    plain = next(r for r in report["configurations"] if r["ranks"] > 1)
    lines += ["", f"The generated package reports {plain['buckets']} gradient buckets (the tail's "
              "parameters, each layer from the last, the embedding: in the order the backward "
              f"finishes them), cut into {plain['pieces']} pieces for the exchange. Largest relative "
              f"difference of a 2-rank step's loss to one rank's: {report['max_loss_rel_diff']:.2e}.", "",
              f"N machines, ring all-reduce of the {report['parameters'] / 1e6:.1f}M float32 gradient "
              f"(backward measured here: {report['backward_s']:.2f} s for {B}x{T} tokens on one "
              f"machine, 2 threads; the embedding is {100 * report['embedding_share']:.0f}% of the "
              "gradient and final only at the end of the backward):", "",
              "| machines | link | sent per rank per step | all-reduce | hidden by the backward | exposed |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in report["machines_model"]:
        lines.append(f"| {row['machines']} | {row['link_gbit']} Gbit/s | {row['sent_mb']:.0f} MB | "
                     f"{row['allreduce_s']:.3f} s | {row['hidden_s']:.3f} s | {row['exposed_s']:.3f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from bench.train_step import ensure_model

    ensure_model()
    load_average = os.getloadavg()[0]
    configurations = [run_configuration(*configuration, args) for configuration in CONFIGURATIONS]
    one = configurations[0]
    max_rel = max(abs(a - b) / abs(b) for r in configurations[2:] for a, b in zip(r["losses"], one["losses"]))
    from pyml.spec import load_spec

    spec = load_spec(ROOT / "specs" / "smollm2_135m.toml")
    embedding_share = spec.embedding.vocab_size * spec.embedding.dim / one["parameters"]
    backward_s = one["median_compute_s"] - one["forward_s"]
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_average": load_average, "steps": args.steps, "warmup": args.warmup,
              "configurations": configurations,
              "max_loss_rel_diff": max_rel, "parameters": one["parameters"], "backward_s": backward_s,
              "embedding_share": embedding_share,
              "machines_model": machines_model(one["parameters"], backward_s, embedding_share)}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "scaling.md").write_text(markdown(report))
    print(markdown(report))
    if max_rel > LOSS_AGREEMENT:
        raise SystemExit(f"error: 2 ranks' losses differ from one rank's by {max_rel:.2e} relative "
                         f"(more than {LOSS_AGREEMENT:g})")


if __name__ == "__main__":
    main()
