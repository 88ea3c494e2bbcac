"""The CUDA case files, each run by a child pytest process under Numba's CUDA simulator (or on a GPU:
PYML_CUDA_TARGET=device, tests/support/cuda_target.py), in the background while the rest of the
suite runs; tests/cuda/test_cuda_sim.py reports their results.

A child process: NUMBA_ENABLE_CUDASIM only works if set before numba.cuda is first imported, and
pytest imports every test module of a session before running any. Each case file sets it, from the
switch, by importing tests/support/cuda_target.py first; this process never does, so that its own
tests see no simulator.

In the background: the simulator runs every GPU thread in Python, on one core, about fifteen
minutes in all on the 2-core development machine, which was half of `make test` when the files ran
one after the other in the foreground. Started as soon as the session's tests are collected, at a
lower priority (`nice`), the children run beside the rest of the suite, whose kernels leave a core
idle much of the time, and the tests that report their results are moved to the end of the session
(tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "cuda"
# Longest first (minutes here: 8, 3, 3, 0.5), so the last result is ready soonest.
CASE_FILES = (
    "fuzz_cuda_cases.py",  # generated packages of random specs and the fuzz corpus vs torch
    "generated_cuda_sim_cases.py",  # the shipped specs' models on device="cuda" vs the CPU
    "cuda_sim_cases.py",  # every CUDA kernel vs the CPU kernel, float64 and float32
    "conformance_cuda_cases.py",  # every linear-map CUDA kernel vs the exact model, bit for bit
    "quantized_decode_cuda_cases.py",  # the CUDA decode step on quantized weights
)
TIMEOUT_S = 2400  # per file, generous: at low priority a child may wait long for a core


class BackgroundRuns:
    """The given case files, run one after another in child processes by a thread of this one."""

    def __init__(self, case_files: list[str]):
        self.results: dict[str, tuple[int | str, str]] = {}
        self.finished = {name: threading.Event() for name in case_files}
        self.child: subprocess.Popen | None = None
        self.stopping = False
        threading.Thread(target=self.run_all, args=(case_files,), daemon=True).start()

    def run_all(self, case_files: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), env.get("PYTHONPATH", "")]
        )
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        try:
            for name in case_files:
                if self.stopping:
                    break
                self.child = subprocess.Popen(
                    [*nice, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES / name)],
                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )  # fmt: skip
                try:
                    output, _ = self.child.communicate(timeout=TIMEOUT_S)
                    self.results[name] = (self.child.returncode, output)
                except subprocess.TimeoutExpired:
                    self.child.kill()
                    output, _ = self.child.communicate()
                    self.results[name] = (f"killed after {TIMEOUT_S} s", output)
                self.finished[name].set()
        finally:
            for event in self.finished.values():  # a stopped run leaves no test waiting
                event.set()

    def result(self, name: str) -> tuple[int | str, str]:
        """(exit status, output) of the child that ran `name`, once it has finished."""
        self.finished[name].wait()
        return self.results.get(name, ("not run: the session was stopping", ""))

    def stop(self) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.kill()


runs: BackgroundRuns | None = None


def start(case_files: list[str]) -> None:
    global runs
    runs = BackgroundRuns([name for name in CASE_FILES if name in case_files])
