"""The four Triton bucket kernels against a float64 torch oracle, in the Triton interpreter (TRITON_INTERPRET=1).

Every output buffer is poisoned with NaN before the kernel runs and guarded by NaN canaries on both sides: it must be
fully overwritten, and nothing may be written outside it.
"""

import pytest
import torch

from bucket_utils import (CANARY, assert_per_matrix, factor as _factor, guarded, guards_intact, layerwise,
                          make_bucket, matrix_slice, product_scale as _product_scale, rel_err)
from powersgd_triton import ops
from powersgd_triton.ops import reference
from powersgd_triton.layout import BucketLayout

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Error bound for values stored in the gradient dtype (the bucket); P/Q are always float32.
STORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FP32_TOL = 1e-5

SHAPE_SETS = {
    # conv weights viewed as (out_channels, -1), biases left uncompressed
    "convnet": [(16, 3, 3, 3), (16,), (32, 16, 3, 3), (32,), (10, 128), (10,)],
    # n = 1, m = 1, rank > min(n, m), sizes that are multiples of no block size
    "ragged": [(1, 70), (70, 1), (3, 5), (33, 65), (129, 17), (2, 2), (7,), (5, 300)],
    # very different sizes in one bucket
    "mixed": [(300, 200), (4, 9), (64,), (17, 1000)],
}
# "mixed"'s spread of rows (P: 300, Q: 1000, past every SHORT_ROWS) at a third of the elements, for the interpreter
# runs of many tile configurations (not a SHAPE_SETS entry: those parametrize every kernel test)
MIXED_LITE = [(300, 24), (4, 9), (64,), (17, 1000)]


def _all_matrices(x, layout, which):
    return torch.cat([x[matrix_slice(s, which)].double() for s in layout.matrices])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=str)
@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("with_error", [False, True], ids=["plain", "error"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_project(dtype, shapes, rank, with_error, rng, backend):
    buf, whole, grads = make_bucket(SHAPE_SETS[shapes], dtype, rng)
    layout = layerwise(buf, grads, rank)
    q = _factor(layout, "q", rng)
    err = torch.randn(layout.e_numel, generator=rng) * 0.3 if with_error else None
    buf64, p64 = buf.double(), torch.zeros(layout.p_numel, dtype=torch.float64)
    reference.project(buf64, layout, q.double(), p64, None if err is None else err.double(), torch.float64)

    p, p_whole = guarded(layout.p_numel)
    ops.project(buf, layout, q, p, err, backend=backend)

    assert rel_err(p, p64) < FP32_TOL
    assert_per_matrix(p, p64, layout, "p", FP32_TOL, scale=_product_scale(layout, buf64, "m", q, "q"))
    assert guards_intact(p_whole, layout.p_numel)
    assert guards_intact(whole, layout.numel, fill=CANARY)
    if with_error:  # M + E written back into the bucket, rounded to its dtype
        assert_per_matrix(buf, buf64, layout, "m", STORE_TOL[dtype])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=str)
@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_project_t(dtype, shapes, rank, rng, backend):
    buf, whole, grads = make_bucket(SHAPE_SETS[shapes], dtype, rng)
    layout = layerwise(buf, grads, rank)
    p = _factor(layout, "p", rng)
    q64 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.double(), q64, torch.float64)

    q, q_whole = guarded(layout.q_numel)
    before = buf.clone()
    ops.project_t(buf, layout, p, q, backend=backend)

    assert rel_err(q, q64) < FP32_TOL
    assert_per_matrix(q, q64, layout, "q", FP32_TOL, scale=_product_scale(layout, buf, "m", p, "p"))
    assert guards_intact(q_whole, layout.q_numel)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("kernel", ["project", "project_t", "reconstruct"])
@pytest.mark.parametrize("prefetch", [3, -1, 1.0, True])
def test_prefetch_out_of_range_is_refused_before_anything_is_written(kernel, prefetch, rng):
    """The kernels unroll at most three register sets (``PREFETCH`` 0-2) and the plans count trips of ``1 +
    PREFETCH`` steps: any other value (a hand-written or damaged config) is a ``ValueError`` naming it, raised
    before any launch (the bucket, the factors and the error memory keep their values)."""
    from powersgd_triton.ops import configs as _configs, launch

    buf, _, grads = make_bucket(SHAPE_SETS[next(iter(SHAPE_SETS))], torch.float32, rng)
    layout = layerwise(buf, grads, 2)
    p, q = _factor(layout, "p", rng), _factor(layout, "q", rng)
    err = torch.randn(layout.e_numel, generator=rng)
    before = [t.clone() for t in (buf, p, q, err)]
    cfg = dict(_configs.INTERPRETER_CONFIGS[kernel], PREFETCH=prefetch)
    with pytest.raises(ValueError, match="PREFETCH"):
        if kernel == "project":
            ops.project(buf, layout, q, p, err, backend="triton", config=cfg)
        elif kernel == "project_t":
            ops.project_t(buf, layout, p, q, backend="triton", config=cfg)
        else:
            ops.reconstruct(buf, layout, p, q, 1.0, error=err, backend="triton", config=cfg)
    with pytest.raises(ValueError, match="PREFETCH"):
        launch.steps_per_trip(cfg)
    assert all(torch.equal(a, b) for a, b in zip((buf, p, q, err), before))


def _well_conditioned(layout, which, gen):
    """Factors U·diag(s)·Vᵀ with singular values in [1, 10], per matrix."""
    x = torch.empty(layout.p_numel if which == "p" else layout.q_numel, dtype=torch.float64)
    for s in layout.matrices:
        rows = s.n if which == "p" else s.m
        off = s.p_offset if which == "p" else s.q_offset
        u, _ = torch.linalg.qr(torch.randn(rows, s.rank, generator=gen, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(s.rank, s.rank, generator=gen, dtype=torch.float64))
        sv = 1 + 9 * torch.rand(s.rank, generator=gen, dtype=torch.float64)
        x[off : off + rows * s.rank] = (u * sv @ v.t()).reshape(-1)
    return x.float()


@pytest.mark.parametrize("which", ["p", "q"])
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=str)
@pytest.mark.parametrize("rank", [1, 3, 4, 8])
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_orthogonalize(which, shapes, rank, epsilon, rng, backend):
    buf, _, grads = make_bucket(SHAPE_SETS[shapes], torch.float32, rng)
    layout = layerwise(buf, grads, rank)
    x = _well_conditioned(layout, which, rng)
    ref = reference.orthogonalize(x.double(), layout, which, epsilon, out=x.double().clone(), compute_dtype=torch.float64)

    out, out_whole = guarded(x.numel())
    x_before = x.clone()
    ops.orthogonalize(x, layout, which, epsilon, out=out, backend=backend)

    assert torch.equal(x, x_before), "out-of-place orthogonalize changed its input"
    assert guards_intact(out_whole, x.numel())
    assert_per_matrix(out, ref, layout, which, FP32_TOL)
    for s in layout.matrices:
        rows = s.n if which == "p" else s.m
        off = s.p_offset if which == "p" else s.q_offset
        o = out[off : off + rows * s.rank].view(rows, s.rank).double()
        xin = x[off : off + rows * s.rank].view(rows, s.rank).double()
        eye = torch.eye(s.rank, dtype=torch.float64)
        assert (o.t() @ o - eye).abs().max().item() < FP32_TOL  # orthonormal columns
        # Gram-Schmidt order: column j spans the first j+1 input columns, i.e. oᵀ·x is upper triangular.
        r = o.t() @ xin
        assert torch.tril(r, diagonal=-1).abs().max().item() < FP32_TOL * xin.norm().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=str)
@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("mode", ["plain", "error", "error_kept"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_reconstruct(dtype, shapes, rank, mode, rng, backend):
    buf, whole, grads = make_bucket(SHAPE_SETS[shapes], dtype, rng)
    layout = layerwise(buf, grads, rank)
    p, q = _factor(layout, "p", rng), _factor(layout, "q", rng)
    scale = 0.25
    old_err = torch.randn(layout.e_numel, generator=rng)
    err = err_whole = None
    if mode != "plain":
        err, err_whole = guarded(layout.e_numel)
        err.copy_(old_err)
    flag = torch.tensor(mode != "error_kept")

    buf64, err64 = buf.double(), old_err.double().clone()
    reference.reconstruct(buf64, layout, p.double(), q.double(), scale, err64 if err is not None else None, None,
                          torch.float64)
    untouched = buf.clone()
    for s in layout.matrices:  # poison the compressed segments: they must all be overwritten
        buf[s.offset : s.offset + s.numel] = float("nan")
    uncompressed_before = layout.gather_uncompressed(untouched)
    # the kernel needs M(before) for the error; poison only where the error is not computed
    if mode != "plain":
        buf.copy_(untouched)
    ops.reconstruct(buf, layout, p, q, scale, err, flag if mode == "error_kept" else None, backend=backend)

    assert rel_err(_all_matrices(buf, layout, "m"), _all_matrices(buf64, layout, "m")) < STORE_TOL[dtype]
    assert_per_matrix(buf, buf64, layout, "m", STORE_TOL[dtype],
                      scale=_product_scale(layout, p, "p", q, "q", scale))
    assert torch.equal(layout.gather_uncompressed(buf), uncompressed_before), "uncompressed gradients touched"
    assert guards_intact(whole, layout.numel, fill=CANARY)
    if mode == "error":
        assert_per_matrix(err, err64, layout, "e", FP32_TOL * 10)
        assert guards_intact(err_whole, layout.e_numel)
    if mode == "error_kept":
        assert torch.equal(err, old_err), "error memory changed although update_error was False"


def _full_step(buf, layout, q0, err=None, epsilon=0.0, backend="triton", configs=None):
    """orthogonalize(Q) -> project -> orthogonalize(P) -> project_t -> reconstruct; returns (P, Q)."""
    c = configs or {}
    q = torch.full_like(q0, float("nan"))
    p = torch.full((layout.p_numel,), float("nan"))
    ops.orthogonalize(q0, layout, "q", epsilon, out=q, backend=backend, config=c.get("orthogonalize"))
    ops.project(buf, layout, q, p, err, backend=backend, config=c.get("project"))
    ops.orthogonalize(p, layout, "p", epsilon, backend=backend, config=c.get("orthogonalize"))
    ops.project_t(buf, layout, p, q, backend=backend, config=c.get("project_t"))
    ops.reconstruct(buf, layout, p, q, 1.0, err, backend=backend, config=c.get("reconstruct"))
    return p, q


def _oracle_step(buf, layout, q0, err):
    """The float64 oracle of :func:`_full_step` on copies: returns (P, Q, bucket, error)."""
    buf64, err64 = buf.double(), err.double().clone()
    q64 = reference.orthogonalize(q0.double(), layout, "q", 0.0, out=q0.double().clone(), compute_dtype=torch.float64)
    p64 = torch.zeros(layout.p_numel, dtype=torch.float64)
    reference.project(buf64, layout, q64, p64, err64, torch.float64)
    reference.orthogonalize(p64, layout, "p", 0.0, compute_dtype=torch.float64)
    reference.project_t(buf64, layout, p64, q64, torch.float64)
    reference.reconstruct(buf64, layout, p64, q64, 1.0, err64, None, torch.float64)
    return p64, q64, buf64, err64


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_matrix_stays_zero(epsilon, dtype, rng, backend):
    shapes = [(20, 30), (40, 12), (8,)]
    buf, _, grads = make_bucket(shapes, dtype, rng)
    grads[1].zero_()  # an all-zero layer gradient
    layout = layerwise(buf, grads, 4)
    zero = next(s for s in layout.matrices if s.grad_index == 1)
    err = torch.zeros(layout.e_numel)
    p, q = _full_step(buf, layout, torch.randn(layout.q_numel, generator=rng), err, epsilon, backend)
    for t in (p, q, buf, err):
        assert torch.isfinite(t).all()
    assert (p[zero.p_offset : zero.p_offset + zero.n * zero.rank] == 0).all()
    assert (q[zero.q_offset : zero.q_offset + zero.m * zero.rank] == 0).all()
    assert (grads[1] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_input_is_not_hidden(bad, rng, backend):
    shapes = [(20, 30), (40, 12), (25, 25)]
    buf, _, grads = make_bucket(shapes, torch.float32, rng)
    grads[1][3, 4] = bad
    layout = layerwise(buf, grads, 2)
    q = torch.randn(layout.q_numel, generator=rng)
    p = torch.full((layout.p_numel,), float("nan"))
    ops.project(buf, layout, q, p, backend=backend)
    for s in layout.matrices:
        pi = p[s.p_offset : s.p_offset + s.n * s.rank]
        if s.grad_index == 1:
            assert not torch.isfinite(pi).all()
        else:
            assert torch.isfinite(pi).all()
    ops.orthogonalize(p, layout, "p", backend=backend)
    bad_p = next(s for s in layout.matrices if s.grad_index == 1)
    assert not torch.isfinite(p[bad_p.p_offset : bad_p.p_offset + bad_p.n * bad_p.rank]).all()


def test_deterministic_bitwise(rng):
    shapes = SHAPE_SETS["mixed"] + SHAPE_SETS["convnet"]
    buf0, _, grads = make_bucket(shapes, torch.float32, rng)
    layout = layerwise(buf0, grads, 4)
    q0 = torch.randn(layout.q_numel, generator=rng)
    e0 = torch.randn(layout.e_numel, generator=rng)
    outs = []
    for _ in range(2):
        buf, err = buf0.clone(), e0.clone()
        p, q = _full_step(buf, layout, q0, err)
        outs.append((p, q, buf, err))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("numel", [37, 1000, 4099])
@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["triton", "torch", "triton-prefetch"])
def test_batched_view_masks_padding(numel, rank, dtype, rng, backend):
    """The whole flat buffer as one s×s matrix, s = ceil(sqrt(N)); padding is read as 0 and never written
    (``triton-prefetch``: the register-prefetch configs, whose last prefetch reads past the matrix, masked)."""
    configs = None
    if backend == "triton-prefetch":
        if numel != 1000:
            pytest.skip("one size is enough for the prefetch path")
        backend, configs = "triton", ALT_CONFIGS["prefetch_split"]
    buf, whole = guarded(numel, dtype, fill=CANARY)
    buf.copy_(torch.randn(numel, generator=rng).to(dtype))
    layout = BucketLayout.batched(numel, rank, "cpu", dtype)
    s = layout.matrices[0].n
    assert s * s >= numel > (s - 1) * (s - 1)
    q0 = torch.randn(layout.q_numel, generator=rng)
    err = torch.randn(layout.e_numel, generator=rng) * 0.1

    p64, q64, buf64, err64 = _oracle_step(buf, layout, q0, err)

    p, q = _full_step(buf, layout, q0, err, backend=backend, configs=configs)
    assert guards_intact(whole, numel, fill=CANARY), "padding or memory past the bucket was written"
    assert rel_err(p, p64) < (FP32_TOL if dtype == torch.float32 else 1e-2)
    assert rel_err(buf, buf64) < STORE_TOL[dtype] * (1 if dtype == torch.float32 else 2)
    assert rel_err(err, err64) < (1e-4 if dtype == torch.float32 else 2e-2)


def test_reference_matches_direct_formulas(rng):
    """The oracle itself against per-matrix torch formulas and Householder QR (up to column signs)."""
    buf, _, grads = make_bucket(SHAPE_SETS["mixed"], torch.float64, rng)
    layout = layerwise(buf, grads, 4)
    q = torch.randn(layout.q_numel, generator=rng, dtype=torch.float64)
    p = torch.zeros(layout.p_numel, dtype=torch.float64)
    reference.project(buf, layout, q, p, compute_dtype=torch.float64)
    reference.orthogonalize(p, layout, "p", compute_dtype=torch.float64)
    for s in layout.matrices:
        mat = grads[s.grad_index].reshape(s.n, s.m)
        qi = q[s.q_offset : s.q_offset + s.m * s.rank].view(s.m, s.rank)
        householder, _ = torch.linalg.qr(mat @ qi)
        pi = p[s.p_offset : s.p_offset + s.n * s.rank].view(s.n, s.rank)
        signs = torch.sign((householder * pi).sum(0))
        assert torch.allclose(pi, householder * signs, atol=1e-10)


ALT_CONFIGS = {
    # tensor-core path (r padded to 16) and row-split project_t with its fixed-order reduction
    "dot_split": {
        "project": dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=True, num_warps=4, num_stages=1),
        "project_t": dict(BLOCK_M=32, BLOCK_K=16, SPLIT_ROWS=48, USE_DOT=True, num_warps=4, num_stages=1),
        "orthogonalize": dict(BLOCK=16, SHORT_ROWS=64, GRAM_ROWS=32, SPLIT_ROWS=48, num_warps=4, num_stages=1),
        "reconstruct": dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=True, num_warps=4, num_stages=1),
    },
    "small_tiles_split": {
        # project: three register sets (PREFETCH 2: 48 columns per loop trip), rows end in masked steps
        "project": dict(BLOCK_N=8, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=2),
        # project_t: one step in flight ahead (PREFETCH 1: 16 rows per loop trip), 20-row splits end in masked steps;
        # maxnreg (a compile option) is ignored by the interpreter
        "project_t": dict(BLOCK_M=16, BLOCK_K=8, SPLIT_ROWS=20, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=1,
                          maxnreg=80),
        "orthogonalize": dict(BLOCK=16, SHORT_ROWS=256, GRAM_ROWS=64, SPLIT_ROWS=16, num_warps=4, num_stages=1),
        # reconstruct: three register sets (PREFETCH 2: 48 columns per loop trip), rows end in masked steps
        "reconstruct": dict(BLOCK_N=8, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=2),
    },
    # the GPU heuristics' register prefetch: the next step's tiles (project_t: the next two) loaded a step early;
    # several loop steps per program, the last prefetch past the end of each row or column range (masked);
    # project_t's 128-column tiles are summed by reduce_splits in 64-column programs
    "prefetch_split": {
        "project": dict(BLOCK_N=4, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=1),
        "project_t": dict(BLOCK_M=128, BLOCK_K=4, SPLIT_ROWS=24, USE_DOT=False, num_warps=4, num_stages=1,
                          PREFETCH=2),
        "orthogonalize": dict(BLOCK=16, SHORT_ROWS=256, GRAM_ROWS=64, SPLIT_ROWS=16, num_warps=4, num_stages=1),
        "reconstruct": dict(BLOCK_N=8, BLOCK_K=16, SPLIT_COLS=32, USE_DOT=False, num_warps=4, num_stages=1,
                            PREFETCH=1),
    },
    # project's and reconstruct's loop-carried prefetch (CARRY), the next step loaded past each row or range
    "carry_split": {
        "project": dict(BLOCK_N=4, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=1, CARRY=True),
        "project_t": dict(BLOCK_M=16, BLOCK_K=8, USE_DOT=False, num_warps=4, num_stages=1),
        "orthogonalize": dict(BLOCK=16, SHORT_ROWS=256, GRAM_ROWS=64, SPLIT_ROWS=16, num_warps=4, num_stages=1),
        "reconstruct": dict(BLOCK_N=8, BLOCK_K=16, SPLIT_COLS=48, USE_DOT=False, num_warps=4, num_stages=1,
                            PREFETCH=1, CARRY=True),
    },
}


@pytest.mark.parametrize("configs", ALT_CONFIGS, ids=str)
@pytest.mark.parametrize("rank", [1, 4])
def test_full_step_with_other_configs(configs, rank, rng):
    """Other block sizes, tl.dot and split-K project_t give the float64 result too (tiles cross matrix edges)."""
    cfg = ALT_CONFIGS[configs]
    buf, whole, grads = make_bucket(MIXED_LITE + SHAPE_SETS["ragged"], torch.float32, rng)
    layout = layerwise(buf, grads, rank)
    q0 = torch.randn(layout.q_numel, generator=rng)
    err = torch.randn(layout.e_numel, generator=rng) * 0.1
    p64, q64, buf64, err64 = _oracle_step(buf, layout, q0, err)

    q, q_whole = guarded(layout.q_numel)
    p, p_whole = guarded(layout.p_numel)
    ops.orthogonalize(q0, layout, "q", out=q, backend="triton", config=cfg["orthogonalize"])
    ops.project(buf, layout, q, p, err, backend="triton", config=cfg["project"])
    ops.orthogonalize(p, layout, "p", backend="triton", config=cfg["orthogonalize"])
    q.fill_(float("nan"))
    ops.project_t(buf, layout, p, q, backend="triton", config=cfg["project_t"])
    ops.reconstruct(buf, layout, p, q, 1.0, err, backend="triton", config=cfg["reconstruct"])

    assert_per_matrix(p, p64, layout, "p", 1e-4)
    assert_per_matrix(q, q64, layout, "q", 1e-4)
    assert_per_matrix(buf, buf64, layout, "m", 1e-4)
    assert guards_intact(q_whole, layout.q_numel) and guards_intact(p_whole, layout.p_numel)
    assert guards_intact(whole, layout.numel, fill=CANARY)


@pytest.mark.parametrize("configs", ["interpreter", *ALT_CONFIGS], ids=str)
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("view", ["layerwise", "batched"])
def test_project_t_reads_only_its_matrices(configs, bad, view, rng):
    """project_t adds nothing from outside its matrices nor from past a row range's end (the unrolled loops' extra
    steps, the clamped rows and columns of unmasked loads): the bucket's other gradients and the memory around it
    are NaN, yet Q is finite and right. A non-finite element at the last row and column of a matrix (the end of a
    row range, where the extra steps re-read it) leaves exactly the oracle's non-finite elements of Q."""
    config = None if configs == "interpreter" else ALT_CONFIGS[configs]["project_t"]
    if view == "layerwise":  # the 1-D gradients stay uncompressed at PyTorch's rate 2
        buf, whole, grads = make_bucket([(50, 13), (7,), (41, 30), (3,), (9, 25), (2,)], torch.float32, rng)
        layout = layerwise(buf, grads, 3, min_rate=2)
        assert len(layout.uncompressed) == 3
        if bad is not None:  # at (n - 1, m - 1) of every matrix
            for s in layout.matrices:
                grads[s.grad_index].view(-1)[-1] = bad
        for off, length in layout.uncompressed:
            buf[off : off + length] = float("nan")
    else:
        buf, whole, _ = make_bucket([(1000,)], torch.float32, rng)
        layout = BucketLayout.batched(buf.numel(), 3, "cpu", torch.float32)
        if bad is not None:
            buf[-1] = bad  # the last valid element; the padding after it is not in the bucket
    whole[: buf.storage_offset()] = float("nan")
    whole[buf.storage_offset() + buf.numel() :] = float("nan")
    p = torch.randn(layout.p_numel, generator=rng)
    q64 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.double(), q64, torch.float64)

    q, q_whole = guarded(layout.q_numel)
    ops.project_t(buf, layout, p, q, backend="triton", config=config)

    finite = torch.isfinite(q64)
    assert torch.equal(torch.isfinite(q), finite)
    assert bool(finite.all()) == (bad is None) and finite.sum() >= layout.q_numel - 3 * len(layout.matrices)
    assert rel_err(q[finite], q64[finite]) < FP32_TOL
    assert guards_intact(q_whole, layout.q_numel)


@pytest.mark.parametrize("backend", ["triton", "torch", "triton-prefetch"])
@pytest.mark.parametrize("local", ["p", "q"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reconstruct_local_error(backend, local, dtype, rng):
    """Alternating hook: output P·(s·Q)ᵀ, error against the local factor (M − P_local·Qᵀ or M − P·Q_localᵀ)."""
    buf, whole, grads = make_bucket(SHAPE_SETS["ragged"] + SHAPE_SETS["convnet"], dtype, rng)
    layout = layerwise(buf, grads, 4)
    p, q = torch.randn(layout.p_numel, generator=rng), torch.randn(layout.q_numel, generator=rng)
    loc = torch.randn(layout.p_numel if local == "p" else layout.q_numel, generator=rng)
    kw = {"local_p": loc} if local == "p" else {"local_q": loc}
    err, err_whole = guarded(layout.e_numel)
    buf64, err64 = buf.double(), torch.zeros(layout.e_numel, dtype=torch.float64)
    kw64 = {k: v.double() for k, v in kw.items()}
    reference.reconstruct(buf64, layout, p.double(), q.double(), 0.5, err64, None, torch.float64, **kw64)
    for s in layout.matrices:  # independent check of the oracle on one matrix
        mat = grads[s.grad_index].reshape(s.n, s.m).double()
        pi = p[s.p_offset : s.p_offset + s.n * s.rank].view(s.n, s.rank).double()
        qi = q[s.q_offset : s.q_offset + s.m * s.rank].view(s.m, s.rank).double()
        if local == "p":
            li = loc[s.p_offset : s.p_offset + s.n * s.rank].view(s.n, s.rank).double()
            expect = mat - li @ qi.t()
        else:
            li = loc[s.q_offset : s.q_offset + s.m * s.rank].view(s.m, s.rank).double()
            expect = mat - pi @ li.t()
        assert torch.allclose(err64[s.e_offset : s.e_offset + s.numel].view(s.n, s.m), expect)
        break
    config = None
    if backend == "triton-prefetch":  # the register prefetch of Q, the local Q and M (a step ahead)
        backend, config = "triton", ALT_CONFIGS["prefetch_split"]["reconstruct"]
    ops.reconstruct(buf, layout, p, q, 0.5, err, torch.tensor(True), backend=backend, config=config, **kw)
    assert_per_matrix(buf, buf64, layout, "m", STORE_TOL[dtype])
    assert_per_matrix(err, err64, layout, "e", 1e-5)
    assert guards_intact(err_whole, layout.e_numel)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_unpack_uncompressed(backend, dtype, rng):
    shapes = [(3000,), (20, 30), (7,), (2, 2), (40, 50), (1500,), (5,)]  # segments longer than one block, too
    buf, whole, grads = make_bucket(shapes, dtype, rng)
    layout = layerwise(buf, grads, 2, min_rate=2)
    assert len(layout.uncompressed) >= 3
    expected = torch.cat([buf[o : o + n] for o, n in layout.uncompressed]).float()
    packed, packed_whole = guarded(layout.uncompressed_numel)
    ops.pack_uncompressed(buf, layout, packed, backend=backend)
    assert torch.equal(packed, expected)
    assert guards_intact(packed_whole, layout.uncompressed_numel)

    compressed_before = [buf[s.offset : s.offset + s.numel].clone() for s in layout.matrices]
    new = torch.randn(layout.uncompressed_numel, generator=rng)
    ops.unpack_uncompressed(new, layout, buf, 0.5, backend=backend)
    assert torch.equal(torch.cat([buf[o : o + n] for o, n in layout.uncompressed]), (new * 0.5).to(dtype))
    for s, before in zip(layout.matrices, compressed_before):
        assert torch.equal(buf[s.offset : s.offset + s.numel], before)
    assert guards_intact(whole, layout.numel, fill=CANARY)


def test_heuristic_config_is_a_candidate(monkeypatch):
    """The untuned GPU default is one of the configs the autotuner times and the AOT tests compile."""
    from powersgd_triton.ops import configs as _configs
    from powersgd_triton.layout import KERNELS
    from powersgd_triton.compat import env as _env

    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)

    class _Layout:
        max_rank = 1

    for rank in range(1, 33):
        _Layout.max_rank = rank
        for dtype in DTYPES:
            for kernel in KERNELS:
                assert _configs.heuristic_config(kernel, _Layout, dtype) in _configs.config_space(kernel, rank, dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("which", ["p", "q"])
@pytest.mark.parametrize("finite", [True, False])
def test_commit_factor(backend, which, finite, rng):
    """Warm-start update: new factors replace kept ones per matrix, except all-zero ones and on non-finite steps."""
    buf, _, grads = make_bucket(SHAPE_SETS["mixed"] + SHAPE_SETS["convnet"], torch.float32, rng)
    layout = layerwise(buf, grads, 4)
    numel = layout.p_numel if which == "p" else layout.q_numel
    kept = torch.randn(numel, generator=rng)
    new = torch.randn(numel, generator=rng)
    zero = layout.matrices[1]
    zsl = matrix_slice(zero, which)
    new[zsl] = 0.0  # this matrix had no gradient: keep its old factor
    before = kept.clone()
    ops.commit_factor(new, kept, layout, which, torch.tensor(finite), backend=backend)
    if not finite:
        assert torch.equal(kept, before)
        return
    for s in layout.matrices:
        sl = matrix_slice(s, which)
        assert torch.equal(kept[sl], before[sl] if s is zero else new[sl])
