"""The launch plans of an H100/H200 (132 SMs) run in the interpreter (issue 39 item 6): every streaming kernel with
the GPU's heuristic config and the row / column splits it plans for 132 SMs, against the torch backend.

On CPU the plans are made for one SM (``ops.launch.DEFAULT_NUM_SMS``) with the interpreter's one config, so the splits
a GPU takes (project_t's row splits and their fixed-order ``reduce_splits``, reconstruct's column ranges) would
otherwise run nowhere before a GPU does. Here the SM count the launchers read is 132 and the config is the GPU
heuristic's (``configs.heuristic_config`` with the interpreter off: the tiles, ``PREFETCH``, ``SPLIT_BF16`` and the
aligned layout's configs), on ragged and aligned layer-wise buckets and the batched view, fp32 and bf16, ranks 4, 8
and 16. Slow tier (each case launches hundreds of interpreted programs).
"""

import pytest
import torch

from bucket_utils import make_bucket, rel_err
from powersgd_triton import ops
from powersgd_triton.compat import env as _env
from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops import aligned, configs, plans, projection_t, reconstruction

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

SMS = 132
SHAPES = {
    # a tall matrix (split over rows by project_t), wide ones (split over columns by reconstruct), odd sizes
    "ragged": [(700, 37), (37,), (33, 900), (5,), (129, 65), (64, 3, 3, 3)],
    # every matrix at multiples of 16 bytes: the aligned path (ops.aligned)
    "aligned": [(512, 48), (48,), (40, 1024), (96, 136), (16,)],
    # one square matrix of side 647 (numel 418,437): wide enough for reconstruct's column splits at every rank
    "batched": [(640, 650), (37,)],
}


def _gpu_config(kernel, layout, dtype, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(_env, "interpreter_enabled", lambda: False)
        return configs.heuristic_config(kernel, layout, dtype, SMS)


@pytest.fixture
def sms(monkeypatch):
    """The launchers plan for 132 SMs (their device_sms), as on an H100/H200."""
    for mod in (projection_t, reconstruction, plans):
        monkeypatch.setattr(mod, "device_sms", lambda device: SMS)


@pytest.mark.parametrize("rank", [4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("view", ["ragged", "aligned", "batched"])
def test_gpu_plans_against_torch(view, dtype, rank, rng, sms, monkeypatch):
    buf, _, grads = make_bucket(SHAPES[view], dtype, rng)
    if view == "batched":
        layout = BucketLayout.batched(buf.numel(), rank, buf.device, dtype)
    else:
        layout = BucketLayout.from_gradients(buf, grads, rank, 2.0)
    assert (aligned.vector_width(layout, dtype) > 0) == (view == "aligned" and rank in (4, 8, 16))
    cfg = {k: _gpu_config(k, layout, dtype, monkeypatch) for k in ("project", "project_t", "reconstruct")}
    steps = {k: plans.plan(k, layout, dtype, cfg[k], num_sms=SMS) for k in cfg}
    # the plans split: project_t over rows (with its reduce launch) where the tall factor is, reconstruct over columns
    if view != "batched":
        assert [launch["kernel"] for launch in steps["project_t"]] == ["project_t", "reduce_splits"]
    assert steps["project_t"][0]["split_rows"] > 0 and steps["reconstruct"][0]["split_cols"] > 0

    q = torch.randn(layout.q_numel, generator=rng)
    err = torch.randn(layout.e_numel, generator=rng)
    out = {}
    for backend in ("triton", "torch"):
        kw = {"config": cfg["project"]} if backend == "triton" else {}
        b, e = buf.clone(), err.clone()
        p = torch.empty(layout.p_numel)
        ops.project(b, layout, q, p, e, backend=backend, **kw)
        p_orth = ops.orthogonalize(p.clone(), layout, "p", backend="torch")
        q_new = torch.empty(layout.q_numel)
        kw = {"config": cfg["project_t"]} if backend == "triton" else {}
        ops.project_t(b, layout, p_orth, q_new, error=e if layout.batched else None, backend=backend, **kw)
        kw = {"config": cfg["reconstruct"]} if backend == "triton" else {}
        ops.reconstruct(b, layout, p_orth, q_new, 0.5, e, torch.tensor(True), backend=backend, **kw)
        out[backend] = (p, q_new, b.float(), e)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    (p_t, q_t, b_t, e_t), (p_r, q_r, b_r, e_r) = out["triton"], out["torch"]
    assert rel_err(p_t, p_r) < 1e-5
    # Q from each backend's own P: the same P up to float32 rounding, orthogonalized (torch) the same way
    assert rel_err(q_t, q_r) < 1e-4
    assert rel_err(b_t, b_r) < max(tol, 1e-4)
    assert rel_err(e_t, e_r) < max(tol, 1e-4)
