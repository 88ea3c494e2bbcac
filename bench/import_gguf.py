"""How long it takes to get the shipped GGUFs into memory: `pyml import-gguf` against transformers.

For each shipped model (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M), in a fresh process each
time, best of `--repeats`:
- pyml: `import_gguf` (read, check, dequantise, write the folder) and `load_gguf_tensors` (the
  same without writing);
- transformers: the model from the GGUF (`from_pretrained(dir, gguf_file=...)`, float32), its
  tokenizer from the GGUF, and the model from the folder pyml wrote.

    python bench/import_gguf.py [--repeats 3] [--models smollm2 gemma3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHIPPED = {
    "smollm2": "pyml.formats.smollm2_gguf",
    "gemma3": "pyml.formats.gemma3_gguf",
}

# Each step is a Python snippet run in a process of its own; it prints its own duration.
STEPS = {
    "pyml import_gguf": """
from pyml.formats.gguf_import import import_gguf
started = time.perf_counter()
import_gguf(gguf_path, folder, progress=False)
""",
    "pyml load_gguf_tensors": """
from pyml.formats.gguf_import import load_gguf_tensors
started = time.perf_counter()
load_gguf_tensors(gguf_path)
""",
    "transformers model from the GGUF": """
import torch
from transformers import AutoModelForCausalLM
started = time.perf_counter()
AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
""",
    "transformers tokenizer from the GGUF": """
from transformers import AutoTokenizer
started = time.perf_counter()
AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
""",
    "transformers model from pyml's folder": """
import torch
from transformers import AutoModelForCausalLM
started = time.perf_counter()
AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
""",
}


def run_step(model: str, step: str, folder: Path) -> float:
    code = (
        "import os, time\nos.environ['HF_HUB_OFFLINE'] = '1'\nfrom pathlib import Path\n"
        "import importlib\n"
        f"gguf_path = importlib.import_module({SHIPPED[model]!r}).shipped_gguf_path()\n"
        f"folder = Path({str(folder)!r})\n"
        + STEPS[step]
        + "print(time.perf_counter() - started)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=sorted(SHIPPED), default=sorted(SHIPPED))
    arguments = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for model in arguments.models:
            folder = Path(scratch) / model
            for step in STEPS:  # the import comes first: the folder load needs its folder
                times = [run_step(model, step, folder) for _ in range(arguments.repeats)]
                results[f"{model}: {step}"] = min(times)
                print(f"{model:8} {step:40} best {min(times):7.2f} s  (all: "
                      + ", ".join(f"{t:.2f}" for t in times) + ")", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
