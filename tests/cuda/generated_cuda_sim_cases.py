"""Generated models built on device="cuda", under Numba's CUDA simulator or on a GPU (the switch of
tests/support/cuda_target.py), against the same model on the CPU (float64): logits, loss, every
gradient, a decoding step, a clipped AdamW step.

Not collected directly (the name does not start with test_): tests/cuda/test_cuda_sim.py runs
it in a child process, since NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported.
The simulator runs every GPU thread in Python, so the batches are tiny.
"""

# isort: off
from tests.support.cuda_target import SIMULATED, check_target  # first: sets the target
# isort: on

import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.package.cuda_products import SWITCH
from tests.support.project_packages import project_package

llama = project_package("llama_tiny")
mlp = project_package("mlp_digits")
TOL = dict(rtol=1e-12, atol=1e-14)


def test_the_target_asked_for_runs():
    check_target()


def pair(package):
    """The same seeded float64 model on the CUDA device and on the CPU."""
    return (package.Model.initialized(seed=2, dtype=np.float64, device="cuda"),
            package.Model.initialized(seed=2, dtype=np.float64))


def host(model, array):
    return model.device.to_host(array)


def test_llama_tiny_logits_loss_gradients_and_decoding(product_route):
    gpu, cpu = pair(llama)
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, llama.model.VOCAB, (2, 3)), rng.integers(0, llama.model.VOCAB, (2, 3))
    targets[1, 0] = -100  # an ignored position
    np.testing.assert_allclose(gpu.forward(ids), cpu.forward(ids), **TOL)
    assert gpu.loss_and_grads(ids, targets) == pytest.approx(cpu.loss_and_grads(ids, targets), rel=1e-12)
    np.testing.assert_allclose(host(gpu, gpu.grads.flat), cpu.grads.flat, **TOL)

    gpu_cache, gpu_logits = gpu.start_decoding(ids[:, :2], 3)
    cpu_cache, cpu_logits = cpu.start_decoding(ids[:, :2], 3)
    np.testing.assert_allclose(gpu_logits, cpu_logits, **TOL)
    np.testing.assert_allclose(gpu.decode(gpu_cache, ids[:, 2]), cpu.decode(cpu_cache, ids[:, 2]), **TOL)


def test_llama_tiny_dpo_step_on_the_device_is_the_cpus():
    """A preference step's device path: the targets' log-probabilities, the token weights copied
    to the device, the weighted backward."""
    from pyml.train.preference import Objective, Pair, pair_rows, preference_loss_and_grads, with_reference

    gpu, cpu = pair(llama)
    rng = np.random.default_rng(1)
    pairs = [Pair(f"pair {i}", rng.integers(0, llama.model.VOCAB, 2).tolist(),
                  rng.integers(0, llama.model.VOCAB, 2).tolist(), rng.integers(0, llama.model.VOCAB, 1).tolist())
             for i in range(2)]
    rows, _ = pair_rows(pairs, 3, 0)
    rows = with_reference(rows, cpu.target_log_probs, 2)
    cpu.params.flat[:] += 0.01  # away from the reference, so that the weights are not all equal
    gpu.device.to_device(cpu.params.flat, gpu.params.flat)
    np.testing.assert_allclose(gpu.target_log_probs(rows.chosen_inputs, rows.chosen_targets),
                               cpu.target_log_probs(rows.chosen_inputs, rows.chosen_targets), **TOL)
    on_gpu, on_cpu = (preference_loss_and_grads(model, rows, Objective("dpo")) for model in (gpu, cpu))
    assert on_gpu.loss == pytest.approx(on_cpu.loss, rel=1e-12)
    np.testing.assert_allclose(host(gpu, gpu.grads.flat), cpu.grads.flat, **TOL)

def test_llama_tiny_recomputed_gradients_are_the_kept_ones():
    """`recompute` (pyml train --recompute) on the device: the backward runs each block again into
    the one slot of saved activations, and the loss and gradients are bit for bit the kept ones'."""
    gpu = llama.Model.initialized(seed=2, dtype=np.float64, device="cuda")
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, llama.model.VOCAB, (2, 3)), rng.integers(0, llama.model.VOCAB, (2, 3))
    kept = gpu.loss_and_grads(ids, targets), host(gpu, gpu.grads.flat).copy()
    gpu.recompute = True
    assert gpu.loss_and_grads(ids, targets) == kept[0]
    assert np.array_equal(host(gpu, gpu.grads.flat), kept[1])


def test_mlp_digits_logits_loss_gradients_and_a_clipped_step(product_route):
    gpu, cpu = pair(mlp)
    rng = np.random.default_rng(0)
    inputs, targets = rng.standard_normal((3, mlp.model.INPUT_DIM)), np.array([0, 4, 9])
    np.testing.assert_allclose(gpu.forward(inputs), cpu.forward(inputs), **TOL)
    assert gpu.loss_and_grads(inputs, targets) == pytest.approx(cpu.loss_and_grads(inputs, targets), rel=1e-12)
    np.testing.assert_allclose(host(gpu, gpu.grads.flat), cpu.grads.flat, **TOL)

    norm = float(np.linalg.norm(cpu.grads.flat))
    settings = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=norm / 2)  # the step clips
    mlp.AdamW(gpu, **settings).step()
    mlp.AdamW(cpu, **settings).step()
    np.testing.assert_allclose(host(gpu, gpu.params.flat), cpu.params.flat, **TOL)


def test_a_bad_products_route_fails_in_one_line_when_the_model_is_made(monkeypatch):
    monkeypatch.setenv(SWITCH, "tensor-cores")
    with pytest.raises(PymlError, match="PYML_CUDA_PRODUCTS='tensor-cores': expected one of kernels, cublas"):
        llama.Model(device="cuda")
    if SIMULATED:
        monkeypatch.setenv(SWITCH, "cublas")
        with pytest.raises(PymlError, match="cublas runs on a GPU; Numba's CUDA simulator runs the kernels only"):
            llama.Model(device="cuda")
