"""A spec too large for the machine generates (its size is stated) and is refused, before anything
is allocated, with one line instead of numpy's memory-error traceback."""

import subprocess
import sys

import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.project import init_project
from tests.support.generator_fuzz import generated_package, to_toml

HUGE = {"name": "huge_mlp", "form": "sequential", "input_dim": 8, "output_dim": 4,
        "layers": [{"kind": "linear", "in_features": 8, "out_features": 4_000_000_000_000},
                   {"kind": "relu"},
                   {"kind": "linear", "in_features": 4_000_000_000_000, "out_features": 4}]}


def test_a_model_larger_than_memory_is_refused_before_allocating():
    _, package = generated_package(HUGE)
    with pytest.raises(PymlError, match=r"spec 'huge_mlp' \(52,000,000,000,004 parameters and "
                                        r"their gradients\) needs [\d.]+ GiB but [\d.]+ GiB"):
        package.Model(dtype=np.float32)


def test_gen_states_the_parameter_count_and_training_memory(tmp_path):
    init_project(tmp_path)
    spec_path = tmp_path / "specs" / "huge_mlp.toml"
    spec_path.write_text(to_toml(HUGE))
    result = subprocess.run([sys.executable, "-m", "pyml.cli", "gen", str(spec_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = result.stdout.splitlines()[-1]
    assert summary.startswith("huge_mlp: 52,000,000,000,004 parameters; float32 training at "
                              "batch 64 holds ")
    assert "AdamW state 387430.2 GiB" in summary and "more than the" in summary
