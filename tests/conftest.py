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

# isort: off
import pyml  # noqa: E402, F401  (first of pyml's and numpy's: see above)
# isort: on

import importlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def pytest_report_header(config):
    from tests.support import anchors

    missing = "fails its tests (PYML_REQUIRE_ANCHORS=1)" if anchors.REQUIRED else "skips its tests"
    return f"a missing anchor (llama.cpp, chromium, mpiexec: tests/support/anchors.py) {missing}"


def pytest_collection_modifyitems(config, items):
    """The CUDA simulator's runs start now, in the background, and the tests that report them go
    last (tests/support/cuda_simulator.py says why)."""
    from tests.support import cuda_simulator

    reporting = [item for item in items if item.path.name == "test_cuda_sim.py"]
    if reporting:
        items[:] = [item for item in items if item not in reporting] + reporting
        cuda_simulator.start([item.callspec.params["cases"] for item in reporting])


def pytest_sessionfinish(session, exitstatus):
    from tests.support import cuda_simulator

    if cuda_simulator.runs is not None:
        cuda_simulator.runs.stop()


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    """{"llama": folder, "gemma3": folder}: tiny imported models of both families."""
    from tests.support.model_folders import tiny_folder

    root = tmp_path_factory.mktemp("tiny")
    return {architecture: tiny_folder(root, architecture) for architecture in ("llama", "gemma3")}


def shipped_folder(tmp_path_factory, module: str, folder: str) -> Path:
    """The folder `pyml import-gguf --shipped` writes for the model of `pyml.formats.<module>`."""
    from pyml.errors import PymlError
    from pyml.formats.gguf_import import import_gguf
    from tests.support import anchors

    shipped = importlib.import_module(f"pyml.formats.{module}")
    try:
        path = shipped.shipped_gguf_path()
    except PymlError as error:
        anchors.missing(str(error))
    return import_gguf(path, tmp_path_factory.mktemp("shipped") / folder, progress=False,
                       name=shipped.SPEC_NAME)  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    return shipped_folder(tmp_path_factory, "smollm2_gguf", "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory) -> Path:
    return shipped_folder(tmp_path_factory, "gemma3_gguf", "gemma3-270m")


def shipped_gguf(module: str) -> Path:
    return importlib.import_module(f"pyml.formats.{module}").shipped_gguf_path()


def gguf_tokenizer(module: str):
    """transformers' tokenizer of the shipped GGUF of `pyml.formats.<module>`, read by its own GGUF
    reader (the independent reference)."""
    from transformers import AutoTokenizer

    gguf = shipped_gguf(module)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def gguf_model(module: str):
    """transformers' model of the shipped GGUF of `pyml.formats.<module>`, in eval mode; shared, so
    no test may change it."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = shipped_gguf(module)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


# the folder first: it skips where the GGUF's package is missing
@pytest.fixture(scope="session")
def smollm2_reference_tokenizer(smollm2_folder):
    return gguf_tokenizer("smollm2_gguf")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_reference_tokenizer):
    """(transformers' model, its tokenizer) of the shipped SmolLM2 GGUF."""
    return gguf_model("smollm2_gguf"), smollm2_reference_tokenizer


@pytest.fixture(scope="session")
def gemma3_reference_tokenizer(gemma3_dir):
    return gguf_tokenizer("gemma3_gguf")


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_reference_tokenizer):
    """(transformers' model, its tokenizer) of the shipped Gemma 3 GGUF."""
    return gguf_model("gemma3_gguf"), gemma3_reference_tokenizer


@pytest.fixture(scope="module")
def shipped_runs() -> dict:
    return {}


@pytest.fixture
def shipped(request, shipped_runs):
    """shipped(family): the family's tests/support/shipped.Shipped, kept for the module (our
    models of the real ones take gigabytes: a module's are freed when it ends), its fixtures
    resolved for the asking test."""
    from tests.support.shipped import Shipped

    def get(family: str) -> Shipped:
        run = shipped_runs.setdefault(family, Shipped(family))
        run.fixtures = request.getfixturevalue
        return run

    return get


def one_step_checkpoint(tmp_path_factory, spec: str, init: Path) -> Path:
    """The checkpoint of one training step (a batch of one 32-token sequence) from `init`, on a
    few lines of text (tokenising the default corpus would take longer than the step)."""
    from pyml.train.run import train
    from tests.support.model_folders import tiny_text

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
