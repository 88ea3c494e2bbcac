"""scikit-learn's 8x8 handwritten digits: 1797 images in 10 classes, shipped inside the
scikit-learn wheel (`sklearn/datasets/data/digits.csv.gz`), so nothing is downloaded."""

import numpy as np

from pyml.errors import PymlError

PIXELS = 64
CLASSES = 10
MAX_PIXEL = 16.0  # pixel values are counts 0..16 of a 4x4 block of the original 32x32 bitmap


def load_digits_split(
    held_out_fraction: float = 0.2, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((train images, train labels), (held-out images, held-out labels)): images (n, 64) float64
    in [0, 1], labels (n,) int64, the held-out images a seeded random choice."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PymlError(
            "the digits data set ships with scikit-learn, which is not installed: "
            "run `pip install scikit-learn`"
        ) from None
    digits = load_digits()
    images = digits.data.astype(np.float64) / MAX_PIXEL
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    held_out_count = round(held_out_fraction * len(labels))
    held_out, train = order[:held_out_count], order[held_out_count:]
    return (images[train], labels[train]), (images[held_out], labels[held_out])
