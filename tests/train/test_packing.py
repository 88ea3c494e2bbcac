"""Packing (`pyml train --packing`, the default for JSONL examples): several examples share a row,
each token's position restarts at its example's first token and attention does not cross from one
example to another. The reference is the examples run one by one: in float64, a packed batch's
loss and every gradient equal the examples' own, weighted by their counted targets (1e-12)."""

from __future__ import annotations

import numpy as np
import pytest

import pyml
from pyml.errors import PymlError
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.train import examples


def drawn_examples(vocab: int, lengths: list[int], seed: int) -> list[examples.Example]:
    """Examples of these token counts: random ids, a prompt of a third untargeted, the rest targets."""
    rng = np.random.default_rng(seed)
    return [examples.Example(f"x:{index}", rng.integers(0, vocab, length).tolist(),
                             [position >= length // 3 for position in range(length)])
            for index, length in enumerate(lengths)]


def alone(model, example: examples.Example) -> tuple[float, np.ndarray, int]:
    """(mean loss, gradient, counted targets) of the example on its own, one row of its length."""
    ids = example.ids
    targets = [token if targeted else IGNORED_TARGET for token, targeted in zip(ids[1:], example.targets[1:])]
    loss = model.loss_and_grads(np.array([ids[:-1]]), np.array([targets]))
    return loss, model.grads.flat.copy(), sum(target != IGNORED_TARGET for target in targets)


@pytest.fixture(scope="module")
def models(tiny_folders):
    """The tiny llama and Gemma 3 folders' models in float64: global attention, and five of six
    layers with a sliding window of 8 and QK-norm."""
    return {name: pyml.compile(folder / "spec.toml").Model.from_safetensors(folder, dtype=np.float64)
            for name, folder in tiny_folders.items()}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_packed_batch_equals_its_examples_one_by_one(models, family):
    model = models[family]
    # lengths above and below the window of 8; rows of 24 places hold two or three examples
    chosen = drawn_examples(model.VOCAB, [13, 6, 9, 17, 4, 11, 7], seed=1)
    rows = examples.rows(chosen, seq=24, pad_id=0, long_examples="truncate", packing=True)
    assert len(rows.inputs) < len(chosen) and rows.examples == len(chosen)
    assert (rows.positions == 0).sum(axis=1).min() >= 2  # every row packs two examples or more
    packed_loss = model.loss_and_grads(rows.inputs, rows.targets, positions=rows.positions)
    packed_grads = model.grads.flat.copy()
    results = [alone(model, example) for example in chosen]
    total = sum(count for _, _, count in results)
    assert total == rows.target_count
    expected_loss = sum(loss * count for loss, _, count in results) / total
    expected_grads = sum(grads * count for _, grads, count in results) / total
    assert packed_loss == pytest.approx(expected_loss, rel=1e-12)
    scale = np.abs(expected_grads).max()
    np.testing.assert_allclose(packed_grads, expected_grads, rtol=1e-12, atol=1e-12 * scale)
    # the forward pass alone (evaluation, `pyml eval`): each example's logits as its own
    logits = model.forward(rows.inputs, positions=rows.positions)
    for row in range(len(rows.inputs)):
        starts = np.flatnonzero(rows.positions[row] == 0).tolist() + [rows.inputs.shape[1]]
        for start, stop in zip(starts, starts[1:]):
            np.testing.assert_allclose(logits[row, start:stop],
                                       model.forward(rows.inputs[row : row + 1, start:stop])[0],
                                       rtol=1e-12, atol=1e-12)


def test_without_positions_a_row_is_one_sequence(models):
    """Positions left out are 0..T-1 in every row: the logits of an unpacked call."""
    model = models["llama"]
    ids = np.random.default_rng(2).integers(0, model.VOCAB, (2, 10))
    np.testing.assert_array_equal(model.forward(ids), model.forward(ids, positions=np.tile(np.arange(10), (2, 1))))


@pytest.mark.parametrize(("positions", "message"), [
    (np.array([[1, 2, 3]]), "starting at 0"),
    (np.array([[0, 1, 3]]), "count 0, 1, 2"),
    (np.array([[0, 1]]), r"must be a \(1, 3\) integer array"),
    (np.array([[0.0, 1.0, 2.0]]), "integer array"),
])
def test_ill_formed_positions_are_refused_in_one_line(models, positions, message):
    with pytest.raises(PymlError, match=message):
        models["llama"].forward(np.array([[1, 2, 3]]), positions=positions)


def test_rows_pack_best_fit_decreasing_with_positions_and_targets_per_example():
    chosen = [examples.Example("x:1", [1, 2, 3, 4], [False, True, True, True]),  # 3 places
              examples.Example("x:2", [5, 6, 7, 8, 9, 10], [False, False, True, True, True, True]),  # 5
              examples.Example("x:3", [11, 12, 13], [False, True, True])]  # 2
    rows = examples.rows(chosen, seq=8, pad_id=0, long_examples="truncate", packing=True)
    # the longest (5 places) opens row 0, then 3 places fill it; 2 places open row 1
    assert rows.inputs.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3], [11, 12, 0, 0, 0, 0, 0, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]
    ignored = IGNORED_TARGET
    assert rows.targets.tolist() == [[ignored, 7, 8, 9, 10, 2, 3, 4], [12, 13] + [ignored] * 6]
    assert (rows.examples, rows.target_count) == (3, 9)
    unpacked = examples.rows(chosen, seq=8, pad_id=0, long_examples="truncate", packing=False)
    assert len(unpacked.inputs) == 3 and unpacked.target_count == 9
    # the padding after an example counts as one of its own: nothing attends to it either way
    assert unpacked.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]


def test_best_fit_decreasing_fills_the_fullest_row_that_holds_an_item():
    bins = examples.best_fit_decreasing([4, 7, 3, 5, 2, 6], capacity=10)
    assert bins == [[1, 2], [5, 0], [3, 4]]  # 7+3, 6+4, 5+2
    sizes = np.random.default_rng(3).integers(1, 20, 200).tolist()
    bins = examples.best_fit_decreasing(sizes, capacity=32)
    assert sorted(index for group in bins for index in group) == list(range(200))
    assert all(sum(sizes[index] for index in group) <= 32 for group in bins)
    assert len(bins) <= 1.25 * sum(sizes) / 32 + 1  # near the bound: best fit wastes little
