"""What several test files share, made once per session: the shipped models imported (Gemma 3
270M about 20 s here), tiny imported models of both families, and the checkpoints and exports of
the fine-tuning loop, since importing, training and writing them are the slow parts.

pyml is imported first, before any test module imports torch or numpy: it puts its thread-pool
settings (`pyml.THREAD_POOL_ENVIRONMENT`) in the environment, which the OpenMP and OpenBLAS pools
read when they load. With torch loaded first, the real models' decode steps ran about 15x slower
here (0.18 against 2.9 tokens/s for Gemma 3 270M), which only costs the suite time.
"""

import os
import tempfile

# The packages the tests generate on demand go to a cache of the tests' own, which lasts across
# sessions on this machine as Numba's cache does, and not into the user's ~/.cache/pyml.
os.environ.setdefault("PYML_CACHE", os.path.join(tempfile.gettempdir(), "pyml-test-cache"))

import pyml  # noqa: E402, F401  (first of pyml's and numpy's: see above)

import importlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def pytest_collection_modifyitems(config, items):
    """The CUDA simulator's runs start now, in the background, and the tests that report them go
    last (tests/cuda_simulator.py says why)."""
    import cuda_simulator

    reporting = [item for item in items if item.module.__name__ == "test_cuda_sim"]
    if reporting:
        items[:] = [item for item in items if item not in reporting] + reporting
        cuda_simulator.start([item.callspec.params["cases"] for item in reporting])


def pytest_sessionfinish(session, exitstatus):
    import cuda_simulator

    if cuda_simulator.runs is not None:
        cuda_simulator.runs.stop()


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    """{"llama": folder, "gemma3": folder}: tiny imported models of both families."""
    from model_folders import tiny_folder

    root = tmp_path_factory.mktemp("tiny")
    return {architecture: tiny_folder(root, architecture) for architecture in ("llama", "gemma3")}


def shipped_folder(tmp_path_factory, module: str, folder: str) -> Path:
    """The folder `pyml import-gguf --shipped` writes for the model of `pyml.formats.<module>`."""
    from pyml.errors import PymlError
    from pyml.formats.gguf_import import import_gguf

    shipped = importlib.import_module(f"pyml.formats.{module}")
    try:
        path = shipped.shipped_gguf_path()
    except PymlError as error:
        pytest.skip(str(error))
    return import_gguf(path, tmp_path_factory.mktemp("shipped") / folder, progress=False,
                       name=shipped.SPEC_NAME)  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    return shipped_folder(tmp_path_factory, "smollm2_gguf", "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory) -> Path:
    return shipped_folder(tmp_path_factory, "gemma3_gguf", "gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' model and tokenizer of the shipped SmolLM2 GGUF, loaded by its own GGUF
    reader (the independent reference), in eval mode; shared, so no test may change it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyml.formats.smollm2_gguf import shipped_gguf_path

    gguf = shipped_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def one_step_checkpoint(tmp_path_factory, spec: str, init: Path) -> Path:
    """The checkpoint of one training step (a batch of one 32-token sequence) from `init`, on a
    few lines of text (tokenising the default corpus would take longer than the step)."""
    from model_folders import tiny_text

    from pyml.train.run import train

    folder = tmp_path_factory.mktemp(f"{spec}_run")
    result = train(
        SPECS / f"{spec}.toml", init=init, data=tiny_text(folder / "text.txt"), steps=1, batch=1,
        seq=32, eval_every=1, eval_batches=1, out=folder / "run", progress=False,
    )  # fmt: skip
    return result.checkpoint


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory, smollm2_folder) -> Path:
    return one_step_checkpoint(tmp_path_factory, "smollm2_135m", smollm2_folder)


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory, gemma3_dir) -> Path:
    return one_step_checkpoint(tmp_path_factory, "gemma3_270m", gemma3_dir)


def exported(tmp_path_factory, checkpoint: Path) -> Path:
    from pyml.formats.gguf_export import export_gguf

    out = tmp_path_factory.mktemp("exported") / f"{checkpoint.parent.parent.name}.gguf"
    return export_gguf(checkpoint, out, "f32", progress=False)


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory, smollm2_checkpoint) -> Path:
    """The fine-tuned SmolLM2's checkpoint as a GGUF, f32."""
    return exported(tmp_path_factory, smollm2_checkpoint)


@pytest.fixture(scope="session")
def gemma3_export(tmp_path_factory, gemma3_checkpoint) -> Path:
    """The fine-tuned Gemma 3's checkpoint as a GGUF, f32."""
    return exported(tmp_path_factory, gemma3_checkpoint)
