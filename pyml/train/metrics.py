"""`metrics.jsonl`, a run's log that people can read and plot: one JSON object per line, one per
optimizer step (step, loss, lr, grad_norm, and tokens_per_s or, for a classifier, examples_per_s)
and one per evaluation (step, held_out_loss, and held_out_accuracy for a classifier), in step
order. A resumed run keeps the lines up to its checkpoint and continues after them, so the file
describes one run even when an interrupted one wrote steps past its last checkpoint.

With `--log tensorboard` the same values also go to TensorBoard event files in `tensorboard/`
(`tensorboard --logdir OUT`), through tensorboardX or, without it, torch's writer (which needs the
tensorboard package); a resumed run purges the events past its checkpoint, as the JSONL drops them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pyml.errors import PymlError
from pyml.outputs import write_bytes

METRICS_FILE = "metrics.jsonl"
EVENTS_FOLDER = "tensorboard"
LOGS = ("tensorboard",)


def event_writer_class(log: str):
    """The SummaryWriter class that `--log` asks for, or a one-line error before anything runs."""
    if log not in LOGS:
        raise PymlError(f"--log must be one of {', '.join(LOGS)}, not {log!r}")
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise PymlError("--log tensorboard needs tensorboardX (pip install tensorboardX), or torch "
                            "with the tensorboard package") from None
    return SummaryWriter


class Metrics:
    def __init__(self, out: Path, resumed_at: int | None, log: str | None = None):
        """The log of the run in `out`; `resumed_at`: the checkpoint's step when resuming; `log`:
        "tensorboard" to write event files too."""
        self.path = Path(out) / METRICS_FILE
        kept = []
        if resumed_at is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line the interrupted run was writing
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= resumed_at:
                    kept.append(line + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(self.path, "".join(kept).encode("utf-8"))
        events_folder = Path(out) / EVENTS_FOLDER
        if resumed_at is None and events_folder.is_dir():  # a fresh start: a run's old events go too
            shutil.rmtree(events_folder)
        self.events = None
        if log is not None:
            purge_step = None if resumed_at is None else resumed_at + 1
            # the writer names its file by the second it opened it: a resume within that second
            # would overwrite the interrupted run's file but for the suffix
            self.events = event_writer_class(log)(str(events_folder), purge_step=purge_step,
                                                  filename_suffix=f".{os.getpid()}.{resumed_at or 0}")

    def write(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.events is not None:
            for name, value in record.items():
                if name != "step" and value is not None:
                    self.events.add_scalar(name, value, record["step"])
            self.events.flush()  # a run killed later still shows every step it logged

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None, rate: float, unit: str,
             more: dict | None = None) -> None:
        """A step's line; `more`: a preference step's metrics (rewards/chosen, ..., TRL's names)."""
        self.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, unit: rate, **(more or {})})

    def evaluation(self, evaluation: dict) -> None:
        self.write({"step": evaluation["step"], **{f"held_out_{name}": value for name, value in
                                                   evaluation.items() if name != "step"}})
