"""Does bf16 training reach float32's result? Issue 45's check on a real fine-tune: SmolLM2-135M
fine-tuned for 50 steps on the example chats (`pyml.train.example_chats`: a question and answer
per topic of CPython's reference docs, an eighth of the topics held out), once with the linear
layers' products in float32 and once with `--precision bf16`, from the same weights, on the same
batches, with `make demo`'s settings (2 rows of 128 tokens, 2 batches a step, cosine schedule
after 3 warmup steps, lr 1e-4). The held-out loss is measured on all held-out batches before the
first step and after the last.

The bf16 run's final held-out loss must be within 1% (relative) of the float32 run's: the script
exits 1 if it is not. Each run's wall time per step is reported beside.

    python bench/bf16_finetune.py [--steps 50]

Results go to bench/results/bf16_finetune.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from train_step import MODELS, ensure_model, machine_description  # noqa: E402

TOLERANCE = 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    from pyml.train import example_chats
    from pyml.train.run import train

    folder = ensure_model(MODELS["smollm2"])
    work = Path(tempfile.mkdtemp(prefix="bf16-finetune-"))
    try:
        example_chats.write(work / "data")
        runs = {}
        for precision in ("f32", "bf16"):
            started = time.perf_counter()
            result = train(None, init=folder, data=work / "data" / "train.jsonl",
                           eval_data=work / "data" / "held_out.jsonl", steps=args.steps, batch=2, seq=128,
                           accumulate=2, schedule="cosine", warmup_steps=3, lr=1e-4, eval_every=args.steps,
                           eval_batches=1000, checkpoint_every=args.steps, out=work / precision,
                           precision=precision, progress=False)
            seconds = time.perf_counter() - started
            runs[precision] = {"held_out_before": result.evaluations[0]["loss"],
                               "held_out_after": result.evaluations[-1]["loss"],
                               "train_losses": result.train_losses, "seconds": seconds,
                               "seconds_per_step": seconds / args.steps}
            print(f"{precision}: held-out loss {runs[precision]['held_out_before']:.4f} -> "
                  f"{runs[precision]['held_out_after']:.4f}, {seconds:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    f32, bf16 = runs["f32"]["held_out_after"], runs["bf16"]["held_out_after"]
    relative = abs(bf16 - f32) / f32
    report = {"date": date.today().isoformat(), "machine": machine_description(), "steps": args.steps,
              "runs": runs, "relative_difference": relative, "tolerance": TOLERANCE}
    lines = ["# bf16 against float32 on a real fine-tune (bench/bf16_finetune.py)", "",
             f"SmolLM2-135M, {args.steps} steps of 2x2 rows of 128 tokens on the example chats, cosine "
             f"schedule, lr 1e-4; {report['date']}, {report['machine']}.", "",
             "| precision | held-out loss before | after | s/step (with the run's evaluations) |",
             "| --- | --- | --- | --- |"]
    for precision, run in runs.items():
        lines.append(f"| {precision} | {run['held_out_before']:.4f} | {run['held_out_after']:.4f} | "
                     f"{run['seconds_per_step']:.2f} |")
    lines += ["", f"bf16's final held-out loss differs from float32's by {relative:.2e} relative "
              f"(asked: within {TOLERANCE:g})."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bf16_finetune.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "bf16_finetune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if relative > TOLERANCE:
        raise SystemExit(f"error: bf16's held-out loss {bf16:.4f} is {relative:.2%} from float32's {f32:.4f}")


if __name__ == "__main__":
    main()
