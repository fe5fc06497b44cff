"""project_t's split tensor-core path (``SPLIT_BF16``: bfloat16 dots on exactly split operands, 2-byte gradients)
against a float64 oracle in the Triton interpreter: float32 accuracy at R 16 (the GPU heuristic's tiles and a row
split) and at rank 8, where the heuristic starts taking it. Moved out of tests/ops/test_kernels.py (rooms of at most 600
lines); the compat tier runs both files.
"""

import contextlib

import pytest
import torch

from _launches import interpreted_launches
from bucket_utils import (assert_per_matrix, factor as _factor, guarded, guards_intact, layerwise, make_bucket,
                          per_matrix_errors, product_scale as _product_scale, rel_err)
from powersgd_triton import ops
from powersgd_triton.ops import reference
from powersgd_triton.layout import BucketLayout

pytest.importorskip("triton")

FP32_TOL = 1e-5


# project_t's split tensor-core path (SPLIT_BF16: bfloat16 dots on exactly split operands) at R 16: the GPU heuristic's
# 64 x 64 tiles, and 32 x 16 tiles over 48-row splits (the fixed-order reduction of partial sums)
SPLIT_DOT_CONFIGS = {
    "heuristic": dict(BLOCK_M=64, BLOCK_K=64, USE_DOT=True, SPLIT_BF16=True, PROGRAMS_PER_SM=3, num_warps=4,
                      num_stages=3),
    "row_split": dict(BLOCK_M=32, BLOCK_K=16, SPLIT_ROWS=48, USE_DOT=True, SPLIT_BF16=True, num_warps=4,
                      num_stages=3),
}
# ranks 16 (R 16) and less (masked rank columns), rows past one split, columns past one tile
SPLIT_DOT_SHAPES = [(300, 40), (70, 33), (16,), (5, 200), (20, 17)]


@contextlib.contextmanager
def _launch_flags(kernel, *names):
    """The constexpr flags ``names`` of every interpreted launch of ``kernel`` inside the block, as dicts."""
    seen = []
    with interpreted_launches() as calls:
        yield seen
    seen.extend({n: bool(kw.get(n, False)) for n in names} for name, _, kw in calls if name == kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", SPLIT_DOT_CONFIGS, ids=str)
@pytest.mark.parametrize("view", ["layerwise", "batched", "batched_error"])
def test_project_t_split_dot_float32_accuracy(dtype, config, view, rng):
    """project_t on the split tensor-core path keeps the float32 dot's accuracy against a float64 oracle: P is
    split into three bfloat16 pieces (a float16 M into two), so the error is about 1e-7, where one bfloat16 rounding
    of P gives about 2e-3 -- the tolerance is checked to fail for that (the oracle on P rounded to bfloat16). The
    batched view's padding error (float32 M + E) takes the float32 ``ieee`` dot's config instead
    (``configs.padding_error_config``). In the
    interpreter the bfloat16 pieces are multiplied as float32 (exact products either way: see
    ``common.SPLIT_OPERAND``); the tensor cores' own rounding is not modelled here."""
    cfg = SPLIT_DOT_CONFIGS[config]
    err = None
    if view == "layerwise":
        buf, whole, grads = make_bucket(SPLIT_DOT_SHAPES, dtype, rng)
        layout = layerwise(buf, grads, 16)
        assert layout.max_rank == 16 and min(s.rank for s in layout.matrices) < 16
    else:
        buf, whole, _ = make_bucket([(40 * 40 - 7,)], dtype, rng)
        layout = BucketLayout.batched(buf.numel(), 16, "cpu", dtype)
        if view == "batched_error":
            err = torch.randn(layout.e_numel, generator=rng) * 0.3
    p = _factor(layout, "p", rng)
    q64 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.double(), q64, torch.float64,
                        error=None if err is None else err.double())
    scale = _product_scale(layout, buf, "m", p, "p")

    q, q_whole = guarded(layout.q_numel)
    with _launch_flags("_project_t_kernel", "SPLIT_BF16", "PAD_ERROR") as flags:
        ops.project_t(buf, layout, p, q, error=err, backend="triton", config=cfg)

    # the split path was taken (the float32 dot would pass the accuracy checks too), but for the padding error
    assert flags == [{"SPLIT_BF16": view != "batched_error", "PAD_ERROR": view == "batched_error"}]
    assert rel_err(q, q64) < FP32_TOL
    assert_per_matrix(q, q64, layout, "q", FP32_TOL, scale=scale)
    assert guards_intact(q_whole, layout.q_numel)
    if config == "heuristic":
        from powersgd_triton.ops import configs

        assert cfg == configs.PROJECT_T_SPLIT_CONFIG
    # both tolerances fail for P rounded to bfloat16 (one bfloat16 dot): by more than 30x and 10x
    q_bf16 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.bfloat16().double(), q_bf16, torch.float64,
                        error=None if err is None else err.double())
    assert rel_err(q_bf16, q64) > 30 * FP32_TOL
    assert max(per_matrix_errors(q_bf16, q64, layout, "q", scale)) > 10 * FP32_TOL



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_project_t_split_dot_at_rank_8(dtype, rng):
    """The GPU heuristic of project_t on 2-byte gradients takes the split tensor-core path from padded rank 8 on
    (``configs.PROJECT_T_SPLIT_MIN_RANK``: R padded to 16, rank columns 8-15 masked): float32 accuracy at max rank
    8, ranks 1-8 (the heuristic's own config, run in the interpreter)."""
    from powersgd_triton.ops import configs
    from powersgd_triton.layout import padded_rank

    cfg = dict(configs.PROJECT_T_SPLIT_CONFIG)
    buf, whole, grads = make_bucket([(300, 40), (70, 33), (5, 200), (20, 17), (9, 3)], dtype, rng)
    layout = layerwise(buf, grads, 8)
    assert layout.max_rank == 8 and min(s.rank for s in layout.matrices) < 8
    assert configs.PROJECT_T_SPLIT_MIN_RANK <= padded_rank(8)
    p = _factor(layout, "p", rng)
    q64 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.double(), q64, torch.float64)
    scale = _product_scale(layout, buf, "m", p, "p")
    q, q_whole = guarded(layout.q_numel)
    ops.project_t(buf, layout, p, q, backend="triton", config=cfg)
    assert rel_err(q, q64) < FP32_TOL
    assert_per_matrix(q, q64, layout, "q", FP32_TOL, scale=scale)
    assert guards_intact(q_whole, layout.q_numel)
