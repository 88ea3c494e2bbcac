"""Generated sequential packages against a PyTorch model built from the same spec, in float64.

Specs written here cover every sequential layer kind: linear with and without bias, ReLU, GELU,
SiLU, RMSNorm (as the first layer, inside a residual, with two eps values, and two norms of one
kind and dims, which share kernels), a residual, and a residual nested in another at the end of its
body and at its start (two joins adding into one input's gradient). Each is generated with
`pyml gen` into a temporary project, imported, and compared with torch autograd: logits, loss, every
gradient, and ten AdamW steps with gradient clipping. mlp_digits, the shipped spec, is compared
the same way.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from pyml.project import init_project

ROOT = Path(__file__).resolve().parents[2]
# Packages are copied here under a name made from their content, so that Numba's cache (keyed by a
# file's path and modification time) is reused by later runs and never stale.
PACKAGES = Path(tempfile.gettempdir()) / "pyml-generated-tests"

EVERY_KIND = """
name = "seq_every_kind"
form = "sequential"
input_dim = 12
output_dim = 7

[[layers]]
kind = "rmsnorm"
name = "norm_in"
dim = 12
eps = 1e-2

[[layers]]
kind = "linear"
name = "fc_in"
in_features = 12
out_features = 16

[[layers]]
kind = "relu"
name = "act_relu"

[[layers]]
kind = "residual"
name = "block"

[[layers.body]]
kind = "rmsnorm"
name = "norm_a"
dim = 16

[[layers.body]]
kind = "linear"
name = "up"
in_features = 16
out_features = 24
bias = false

[[layers.body]]
kind = "silu"
name = "act_silu"

[[layers.body]]
kind = "linear"
name = "down"
in_features = 24
out_features = 16

[[layers]]
kind = "gelu"
name = "act_gelu"

[[layers]]
kind = "rmsnorm"
name = "norm_b"
dim = 16

[[layers]]
kind = "linear"
name = "head"
in_features = 16
out_features = 7
bias = false
"""

# A residual whose body ends in another residual.
NESTED_RESIDUAL = """
name = "seq_nested_residual"
form = "sequential"
input_dim = 10
output_dim = 5

[[layers]]
kind = "linear"
name = "fc_in"
in_features = 10
out_features = 8

[[layers]]
kind = "residual"
name = "outer"

[[layers.body]]
kind = "linear"
name = "mix_outer"
in_features = 8
out_features = 8

[[layers.body]]
kind = "residual"
name = "inner"

[[layers.body.body]]
kind = "gelu"
name = "act"

[[layers.body.body]]
kind = "linear"
name = "mix_inner"
in_features = 8
out_features = 8
bias = false

[[layers]]
kind = "linear"
name = "head"
in_features = 8
out_features = 5
"""


class Residual(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def torch_layers(layers, named):
    """torch modules for the spec's layer tables; `named` collects the ones with parameters."""
    modules = []
    for layer in layers:
        kind = layer["kind"]
        if kind == "linear":
            module = torch.nn.Linear(layer["in_features"], layer["out_features"],
                                     bias=layer.get("bias", True), dtype=torch.float64)
        elif kind == "rmsnorm":
            module = torch.nn.RMSNorm(layer["dim"], eps=layer.get("eps", 1e-5), dtype=torch.float64)
        elif kind == "residual":
            module = Residual(torch.nn.Sequential(*torch_layers(layer["body"], named)))
        else:
            module = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "silu": torch.nn.SiLU}[kind]()
        if kind in ("linear", "rmsnorm"):
            named[layer["name"]] = module
        modules.append(module)
    return modules


def torch_model(spec_text):
    named = {}
    model = torch.nn.Sequential(*torch_layers(tomllib.loads(spec_text)["layers"], named))
    return model, named


def generated_package(spec_text, tmp_path):
    """`pyml gen` of the spec into a temporary project root, imported."""
    name = tomllib.loads(spec_text)["name"]
    project = tmp_path / "project"
    init_project(project)
    (project / "specs" / f"{name}.toml").write_text(spec_text)
    # this tree's pyml, whichever one is installed: the generator under test is the one beside the test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pyml.cli", "gen", f"specs/{name}.toml"],
                            cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return import_package(project / "gen" / name)


def import_package(folder):
    files = sorted(path for path in folder.iterdir() if path.suffix == ".py")
    digest = hashlib.sha256(b"".join(path.name.encode() + path.read_bytes() for path in files))
    module_name = f"{folder.name}_{digest.hexdigest()[:16]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    target = PACKAGES / module_name
    if not target.exists():
        staging = PACKAGES / f".{module_name}.{id(files)}.tmp"
        staging.mkdir(parents=True)
        for path in files:
            shutil.copy2(path, staging / path.name)
        staging.replace(target)  # atomic, so a concurrent run never imports half a package
    spec = importlib.util.spec_from_file_location(
        module_name, target / "__init__.py", submodule_search_locations=[str(target)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = package
    spec.loader.exec_module(package)
    return package


def torch_like(package, spec_text):
    """Our seeded initialisation, and a torch model holding the same weights."""
    ours = package.Model.initialized(seed=1, dtype=np.float64)
    theirs, named = torch_model(spec_text)
    tensors = ours.host_tensors()
    with torch.no_grad():
        for name, module in named.items():
            module.weight.copy_(torch.from_numpy(tensors[f"{name}.weight"]))
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(torch.from_numpy(tensors[f"{name}.bias"]))
    assert len(tensors) == sum(1 for _ in theirs.parameters())  # no parameter left out either side
    return ours, theirs, named


def named_gradients(package, model):
    """`model`'s gradients under their tensor names: a second model holding them as weights."""
    holder = package.Model(dtype=np.float64)
    holder.params.flat[:] = model.grads.flat
    return holder.host_tensors()


def torch_tensors(named, attribute=None):
    tensors = {}
    for name, module in named.items():
        for part in ("weight", "bias"):
            value = getattr(module, part, None)
            if value is not None:
                value = value.grad if attribute == "grad" else value.detach()
                tensors[f"{name}.{part}"] = value.numpy().copy()
    return tensors


def data(package, seed, batch):
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((batch, package.model.INPUT_DIM)) * 2.0
    return inputs, rng.integers(0, package.model.OUTPUT_DIM, batch)

# A residual whose body starts with another residual: both joins add into the gradient of the same
# input, fc_in's output, and the outer one (the first the backward reaches) owns its buffer.
RESIDUAL_FIRST_IN_BODY = """
name = "seq_residual_first_in_body"
form = "sequential"
input_dim = 10
output_dim = 5

[[layers]]
kind = "linear"
name = "fc_in"
in_features = 10
out_features = 8

[[layers]]
kind = "residual"
name = "outer"

[[layers.body]]
kind = "residual"
name = "inner"

[[layers.body.body]]
kind = "linear"
name = "mix_inner"
in_features = 8
out_features = 8

[[layers.body]]
kind = "silu"
name = "act"

[[layers.body]]
kind = "linear"
name = "mix_outer"
in_features = 8
out_features = 8

[[layers]]
kind = "linear"
name = "head"
in_features = 8
out_features = 5
"""


def relative_error(ours, theirs):
    return np.abs(ours - theirs).max() / np.abs(theirs).max()


SPECS = {"every_kind": EVERY_KIND, "nested_residual": NESTED_RESIDUAL,
         "residual_first_in_body": RESIDUAL_FIRST_IN_BODY,
         "mlp_digits": (ROOT / "specs" / "mlp_digits.toml").read_text()}
@pytest.fixture(scope="module", params=[
    "every_kind", "mlp_digits",
    "nested_residual", "residual_first_in_body",
])
def case(request, tmp_path_factory):
    text = SPECS[request.param]
    return generated_package(text, tmp_path_factory.mktemp(request.param)), text


def test_loss_logits_and_gradients_match_torch(case):
    package, text = case
    ours, theirs, named = torch_like(package, text)
    inputs, targets = data(package, seed=0, batch=9)
    logits = theirs(torch.from_numpy(inputs))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(targets))
    loss.backward()
    assert relative_error(ours.forward(inputs), logits.detach().numpy()) < 1e-12
    assert ours.loss_and_grads(inputs, targets) == pytest.approx(loss.item(), rel=1e-12)
    grads, expected = named_gradients(package, ours), torch_tensors(named, "grad")
    assert grads.keys() == expected.keys()
    for name in expected:
        assert relative_error(grads[name], expected[name]) < 1e-10, name


def test_ten_clipped_adamw_steps_track_torch(case):
    """With torch.nn.utils.clip_grad_norm_ before each torch.optim.AdamW step; batches of 4 and 32
    alternate, so the gradient norm lies on both sides of the limit (asserted)."""
    package, text = case
    ours, theirs, named = torch_like(package, text)
    start = torch_tensors(named)
    settings = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    limit = median_gradient_norm(package, text)
    optimizer = package.AdamW(ours, **settings, max_grad_norm=limit)
    reference = torch.optim.AdamW(theirs.parameters(), **settings)
    norms = []
    for step in range(10):
        inputs, targets = data(package, seed=10 + step, batch=4 if step % 2 else 32)
        reference.zero_grad()
        loss = torch.nn.functional.cross_entropy(theirs(torch.from_numpy(inputs)),
                                                 torch.from_numpy(targets))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(theirs.parameters(), limit).item())
        reference.step()
        assert package.train_step(ours, optimizer, inputs, targets) == pytest.approx(
            loss.item(), rel=1e-10)
    assert min(norms) < limit < max(norms), norms
    tensors, expected = ours.host_tensors(), torch_tensors(named)
    for name in expected:
        assert relative_error(tensors[name], expected[name]) < 1e-10, name
        assert relative_error(tensors[name] - start[name], expected[name] - start[name]) < 1e-9, name


def median_gradient_norm(package, text):
    """The median gradient norm of the test's batches at the initial weights: a limit that some
    steps exceed and some do not."""
    _, theirs, _ = torch_like(package, text)
    norms = []
    for step in range(10):
        inputs, targets = data(package, seed=10 + step, batch=4 if step % 2 else 32)
        theirs.zero_grad()
        torch.nn.functional.cross_entropy(theirs(torch.from_numpy(inputs)),
                                          torch.from_numpy(targets)).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters()]).item())
    return float(np.median(norms))
