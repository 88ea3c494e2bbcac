"""A DPO step (issue 44): pyml against TRL's DPOTrainer with peft, LoRA on the shipped SmolLM2-135M,
a batch of 2 pairs of 256-token sequences (a 128-token prompt and two 128-token answers, random
ids, seeded; the same for every system), AdamW, each system in a process of its own, back to back,
on the same threads.

- `pyml`: `pyml train --method dpo --lora-rank 16` (q, k, v, o, gate, up, down; the base's linear maps
  read from the GGUF as stored): one forward and one backward of the 4 sequences; the reference's
  log-probabilities are computed once before training, so they are not in the step.
- `trl`: DPOTrainer (peft LoRA, the same targets) on transformers' dequantized float32 model,
  `compute_loss` + backward + torch.optim.AdamW: its default, the reference's forward (the adapters
  disabled) run in every step.
- `trl_precomputed`: the same with `precompute_ref_log_probs=True`, the reference in the batch, as
  pyml does it.

The first step (compilation, page faults) is not counted: the step time is the median of the others.

    python bench/dpo_step.py --folder DIR [--threads 2] [--steps 4] [--systems pyml,trl,...]

DIR is the imported shipped SmolLM2 (`pyml import-gguf --shipped smollm2`, or `make demo`'s).
Results go to bench/results/dpo_step.{json,md}.
"""

from __future__ import annotations

import os

START_ENVIRONMENT = dict(os.environ)  # before pyml's import sets thread-pool variables

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qlora import transformers_copy  # noqa: E402
from scale import run_measured, thread_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
RANK, ALPHA, LR, BETA = 16, 32.0, 1e-5, 0.1
PAIRS, PROMPT, ANSWER = 2, 128, 128
SYSTEMS = {
    "pyml": "pyml, LoRA over the base as stored",
    "trl": "TRL DPOTrainer + peft, float32 (reference forward each step)",
    "trl_precomputed": "TRL DPOTrainer + peft, float32, precompute_ref_log_probs",
}


def pairs(vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_ids": rng.integers(3, vocab, PROMPT).tolist(), "chosen_ids": rng.integers(3, vocab, ANSWER).tolist(),
             "rejected_ids": rng.integers(3, vocab, ANSWER).tolist()} for _ in range(PAIRS)]


def pyml_steps(folder: Path, steps: int) -> list[float]:
    from pyml.packages import spec_file
    from pyml.train.lora import lora_settings, lora_spec
    from pyml.train.preference import Objective, Pair, pair_rows, preference_step, with_reference

    _, package = lora_spec(spec_file(folder), lora_settings(RANK, ALPHA, TARGETS))
    model = package.Model.from_base(folder, seed=0)
    batch = [Pair("bench", p["prompt_ids"], p["chosen_ids"], p["rejected_ids"]) for p in pairs(package.Model.VOCAB)]
    rows, _ = pair_rows(batch, PROMPT + ANSWER - 1, 0)
    rows = with_reference(rows, model.target_log_probs, PAIRS)
    optimizer = package.AdamW(model, lr=LR)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        preference_step(model, optimizer, rows, Objective("dpo", BETA))
        seconds.append(time.perf_counter() - started)
    return seconds


def trl_steps(loadable: Path, threads: int, steps: int, precomputed: bool) -> list[float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from pyml.train.lora import PEFT_MODULES

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(loadable, dtype=torch.float32, attn_implementation="sdpa")
    examples = pairs(model.config.vocab_size)
    args = DPOConfig(output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "pyml-bench-dpo"), learning_rate=LR,
                     beta=BETA, bf16=False, gradient_checkpointing=False, report_to=[], max_length=None,
                     use_cpu=True, per_device_train_batch_size=PAIRS)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                        target_modules=[PEFT_MODULES[t] for t in TARGETS])
    text = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # the trainer wants one
    trainer = DPOTrainer(model=model, args=args, train_dataset=text, peft_config=config,
                         processing_class=AutoTokenizer.from_pretrained(loadable))
    trainer.precompute_ref_logps = precomputed
    batch = trainer.data_collator(examples)
    if precomputed:  # the reference's log-probabilities, as _precompute_ref_logps puts them in the batch
        with torch.no_grad():
            batch["ref_chosen_logps"], batch["ref_rejected_logps"] = trainer.compute_ref_log_probs(trainer.model, batch)
    optimizer = torch.optim.AdamW([p for p in trainer.model.parameters() if p.requires_grad], lr=LR)
    trainer.model.train()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="the imported shipped SmolLM2 folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"which to run, comma-separated (default all: {', '.join(SYSTEMS)})")
    for internal in ("--system", "--loadable"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        if args.system == "pyml":
            seconds = pyml_steps(args.folder, args.steps)
        else:
            seconds = trl_steps(Path(args.loadable), args.threads, args.steps, args.system == "trl_precomputed")
        print(json.dumps(seconds))
        return
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2 (the first step is not counted)")
    asked = args.systems.split(",")
    if set(asked) - set(SYSTEMS):
        sys.exit(f"error: --systems takes {', '.join(SYSTEMS)}")
    folder = args.folder.resolve()
    loadable = transformers_copy(folder)
    results = {}
    for system in [s for s in SYSTEMS if s in asked]:
        command = [sys.executable, __file__, "--system", system, "--folder", str(folder), "--loadable", str(loadable),
                   "--threads", str(args.threads), "--steps", str(args.steps)]
        out, wall, peak = run_measured(command, thread_environment(args.threads))
        seconds = json.loads(out.strip().splitlines()[-1])
        step = statistics.median(seconds[1:])
        tokens = 2 * PAIRS * (PROMPT + ANSWER)
        results[system] = {"peak_rss_gib": peak, "step_seconds": seconds, "median_step_s": step,
                           "tokens_per_s": tokens / step, "process_wall_s": wall}
        print(system, json.dumps(results[system]), flush=True)

    from train_step import machine_description

    general = folder / "gguf_general.json"  # an imported folder names its model there
    name = json.loads(general.read_text()).get("general.name", folder.name) if general.is_file() else folder.name
    report = {"model": name, "date": date.today().isoformat(), "machine": machine_description(),
              "threads": args.threads, "steps": args.steps, "rank": RANK, "pairs": PAIRS,
              "sequence": PROMPT + ANSWER, "results": results}
    lines = [f"DPO step: {name}, LoRA rank {RANK} on {', '.join(TARGETS)}, {PAIRS} pairs of "
             f"{PROMPT + ANSWER}-token sequences a step, AdamW; {report['date']}: {report['machine']}; "
             f"{args.threads} threads; median of {args.steps - 1} steps after the first.", "",
             "| system | peak RSS, GiB | step, s | tokens/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {SYSTEMS[s]} | {r['peak_rss_gib']:.2f} | {r['median_step_s']:.2f} | {r['tokens_per_s']:.1f} |"
              for s, r in results.items()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dpo_step.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "dpo_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
