"""The aligned layout (issue 39, ``powersgd_triton.ops.aligned``): which buckets take the 16-byte path, and that the
streaming and elementwise kernels give the masked path's numbers there, in the Triton interpreter.

On a bucket whose matrices start at and span multiples of 16 bytes, project, reconstruct, average and the packing of
the uncompressed gradients launch with ``ALIGN`` (int32 offsets, alignment hints, per-row masks) and must write the
same bits as the masked path (``ALIGN=False`` in the config, same tiles); project_t's float32 path sums row by row
(the masked path in blocks of rows), so both are held to the float64 oracle, and its split tensor-core path must
write the masked path's bits. Buffers are poisoned and guarded (``bucket_utils.guarded``): the aligned path writes
exactly what it should.
"""

import pytest
import torch

from bucket_utils import CANARY, guarded, guards_intact, layerwise, make_bucket, rel_err
from powersgd_triton import ops
from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops import aligned, reference

pytest.importorskip("triton")

# m: 16, 32, 72, 128; offsets at multiples of 8 elements (biases of 8 and 24); a row count (37) that is no multiple
# of any tile, so every tail is masked
ALIGNED = [(24, 16), (8,), (40, 32), (16, 3, 3, 8), (24,), (37, 128), (8,)]
DTYPES = [torch.float32, torch.bfloat16]
# the tiles of both runs: the masked path's own (BLOCK_K a multiple of every vector width), no prefetch and two
# steps in flight; project_t: 2 rows per unrolled trip of the aligned path (37 rows: a tail of 1)
PROJECT = [dict(BLOCK_N=8, BLOCK_K=16, USE_DOT=False), dict(BLOCK_N=4, BLOCK_K=32, USE_DOT=False, PREFETCH=1)]
RECONSTRUCT = [dict(BLOCK_N=8, BLOCK_K=16, USE_DOT=False), dict(BLOCK_N=4, BLOCK_K=32, USE_DOT=False, PREFETCH=2)]


def _bucket(dtype, rng, shapes=ALIGNED, rank=4):
    buf, whole, grads = make_bucket(shapes, dtype, rng)
    return buf, whole, layerwise(buf, grads, rank, min_rate=2.0)


def _plan_align(layout, prefix):
    """The ALIGN constexpr of every launch plan of ``layout`` whose key starts with ``prefix``."""
    out = []
    for key, plan in layout._tiles.items():
        if isinstance(key, tuple) and key and key[0] == prefix:
            out.append(plan[0].kwargs["ALIGN"])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_vector_width(dtype, rng):
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    buf, _, layout = _bucket(dtype, rng)
    assert aligned.vector_width(layout, dtype) == vec
    # one matrix whose rows are not whole 16-byte groups (ResNet-50's 64 x 147 first convolution)
    _, _, ragged = _bucket(dtype, rng, ALIGNED + [(16, 3, 7, 7)])
    assert aligned.vector_width(ragged, dtype) == 0
    # a matrix that starts off a 16-byte boundary (a 3-element bias before it)
    _, _, shifted = _bucket(dtype, rng, [(3,)] + ALIGNED)
    assert aligned.vector_width(shifted, dtype) == 0
    # ranks below the padded rank (rank 3 pads to 4: Q's rows are 3 float32, no 16-byte groups)
    _, _, rank3 = _bucket(dtype, rng, rank=3)
    assert aligned.vector_width(rank3, dtype) == 0
    # the batched view masks its padding per element
    assert aligned.vector_width(BucketLayout.batched(4096, 4, "cpu", dtype), dtype) == 0
    # a tl.dot config, ALIGN=False, or steps that are not whole vectors keep the masked path
    assert aligned.aligned_width(layout, dtype, dict(BLOCK_K=32, USE_DOT=False)) == vec
    assert aligned.aligned_width(layout, dtype, dict(BLOCK_K=32, USE_DOT=True)) == 0
    assert aligned.aligned_width(layout, dtype, dict(BLOCK_K=32, USE_DOT=False, ALIGN=False)) == 0
    assert aligned.aligned_width(layout, dtype, dict(BLOCK_K=4, USE_DOT=False)) == (vec if vec == 4 else 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["plain", "error", "error+p2+loss_scale"])
@pytest.mark.parametrize("cfg", range(len(PROJECT)))
def test_project_aligned_is_masked(dtype, variant, cfg, rng):
    buf, whole, layout = _bucket(dtype, rng)
    q = torch.randn(layout.q_numel, generator=rng)
    err = torch.randn(layout.e_numel, generator=rng) if variant != "plain" else None
    ls = torch.tensor([1024.0]) if "loss_scale" in variant else None
    outs = []
    for align in (True, False):
        b, bw = guarded(layout.numel, dtype, fill=CANARY)
        b.copy_(buf)
        p, pw = guarded(layout.p_numel)
        p2 = guarded(layout.p_numel)[0] if "p2" in variant else None
        e = err.clone() if err is not None else None
        ops.project(b, layout, q, p, e, p2=p2, loss_scale=ls, backend="triton", config=dict(PROJECT[cfg], ALIGN=align))
        assert guards_intact(pw, layout.p_numel) and guards_intact(bw, layout.numel, fill=CANARY)
        outs.append((b.clone(), p.clone(), None if p2 is None else p2.clone()))
    assert _plan_align(layout, "launch:project") == [16 // buf.element_size(), 0]
    (b1, p1, q1), (b0, p0, q0) = outs
    assert torch.equal(b1, b0) and torch.equal(p1, p0)
    if q1 is not None:
        assert torch.equal(q1, p1)
    p64 = torch.zeros(layout.p_numel, dtype=torch.float64)
    e64 = None if err is None else err.double() * (1024.0 if ls is not None else 1.0)
    reference.project(buf.double(), layout, q.double(), p64, e64, torch.float64)
    assert rel_err(p1, p64) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["plain", "error+flags+commit", "local_q+loss_scale", "local_p"])
@pytest.mark.parametrize("cfg", range(len(RECONSTRUCT)))
def test_reconstruct_aligned_is_masked(dtype, variant, cfg, rng):
    buf, _, layout = _bucket(dtype, rng)
    p = torch.randn(layout.p_numel, generator=rng)
    q = torch.randn(layout.q_numel, generator=rng)
    err = torch.randn(layout.e_numel, generator=rng)
    q_avg = torch.randn(layout.q_numel, generator=rng) * 3
    unc = torch.randn(layout.uncompressed_numel, generator=rng).to(dtype)
    outs = []
    for align in (True, False):
        b, bw = guarded(layout.numel, dtype, fill=CANARY)
        b.copy_(buf)
        e, ew = guarded(layout.e_numel)
        e.copy_(err)
        kw = {}
        if variant == "error+flags+commit":
            qa = q_avg.clone()
            flags = ops.average(qa, layout, "q", b, unc.clone(), 3, backend="triton")
            kept = torch.zeros(layout.q_numel)
            kw = dict(update_error=flags, commit=("q", kept))
            q_in = qa
        elif variant == "local_q+loss_scale":
            kw = dict(update_error=torch.tensor(True), local_q=q * 0.5, loss_scale=torch.tensor([8.0]))
            q_in = q
        elif variant == "local_p":
            kw = dict(update_error=torch.tensor(True), local_p=p * 2.0)
            q_in = q
        else:
            q_in, e = q, None
        ops.reconstruct(b, layout, p, q_in, 0.25, e, backend="triton", config=dict(RECONSTRUCT[cfg], ALIGN=align),
                        **kw)
        assert guards_intact(bw, layout.numel, fill=CANARY)
        if e is not None:
            assert guards_intact(ew, layout.e_numel)
        outs.append((b.clone(), None if e is None else e.clone(), kw.get("commit", (None, None))[1]))
    assert sorted(_plan_align(layout, "launch:reconstruct")) == [0, 16 // buf.element_size()]
    (b1, e1, k1), (b0, e0, k0) = outs
    assert torch.equal(b1, b0)
    if e1 is not None:
        assert torch.equal(e1, e0)
    if k1 is not None:
        assert torch.equal(k1, k0)
    if variant == "plain":  # against the oracle once
        b64 = buf.double()
        reference.reconstruct(b64, layout, p.double(), q.double(), 0.25, None, True, compute_dtype=torch.float64)
        assert rel_err(b1, b64) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [0, 16], ids=["whole", "split16"])
def test_project_t_aligned(dtype, split, rng):
    """The float32 FMA path (any gradient dtype under an explicit config) against the float64 oracle and the masked
    path; row splits write partial sums that reduce_splits adds up; a second Q output; Q in the bucket's dtype."""
    buf, _, layout = _bucket(dtype, rng)
    p = torch.randn(layout.p_numel, generator=rng)
    q64 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.double(), q64, compute_dtype=torch.float64)
    cfg = dict(BLOCK_M=32, BLOCK_K=2, USE_DOT=False, SPLIT_ROWS=split)
    got = {}
    for align in (True, False):
        q, qw = guarded(layout.q_numel)
        q2, q2w = guarded(layout.q_numel, dtype)
        ops.project_t(buf, layout, p, q, q2=q2, backend="triton", config=dict(cfg, ALIGN=align))
        assert guards_intact(qw, layout.q_numel) and guards_intact(q2w, layout.q_numel)
        assert torch.equal(q2, q.to(dtype))
        got[align] = q.clone()
    assert sorted(_plan_align(layout, "launch:project_t")) == [0, 16 // buf.element_size()]
    assert rel_err(got[True], q64) < 1e-5
    assert rel_err(got[True], got[False]) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_project_t_aligned_split_dot(dtype, rng):
    """The split tensor-core path of 2-byte gradients on the aligned layout: the masked path's bits."""
    buf, _, layout = _bucket(dtype, rng)
    p = torch.randn(layout.p_numel, generator=rng)
    cfg = dict(BLOCK_M=32, BLOCK_K=16, USE_DOT=True, SPLIT_BF16=True, SPLIT_ROWS=16, num_stages=3)
    got = {}
    for align in (True, False):
        q, qw = guarded(layout.q_numel)
        ops.project_t(buf, layout, p, q, backend="triton", config=dict(cfg, ALIGN=align))
        assert guards_intact(qw, layout.q_numel)
        got[align] = q.clone()
    assert sorted(_plan_align(layout, "launch:project_t")) == [0, 8]
    assert torch.equal(got[True], got[False])
    q64 = torch.zeros(layout.q_numel, dtype=torch.float64)
    reference.project_t(buf.double(), layout, p.double(), q64, compute_dtype=torch.float64)
    assert rel_err(got[True], q64) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", [2, 3])
def test_average_and_packing_aligned(dtype, world, rng):
    """average (a power-of-two world size multiplies by the reciprocal: the same bits), pack and unpack on chunks at
    16-byte boundaries: torch's numbers, the flags torch's test gives."""
    buf, _, layout = _bucket(dtype, rng)
    packed, pw = guarded(layout.uncompressed_numel, dtype)
    ops.pack_uncompressed(buf, layout, packed, backend="triton")
    assert guards_intact(pw, layout.uncompressed_numel)
    assert torch.equal(packed, layout.gather_uncompressed(buf))
    from powersgd_triton.ops import segments

    assert segments.chunk_alignment(layout) == segments.CHUNK_ALIGN
    assert segments.chunk_alignment(layout, "q") == segments.CHUNK_ALIGN
    q = torch.randn(layout.q_numel, generator=rng)
    q[layout.matrices[0].q_offset:layout.matrices[0].q_offset + 16 * 4] = 0.0  # one matrix's Q all zero
    b_t, b_r = buf.clone(), buf.clone()
    q_t, q_r = q.clone(), q.clone()
    flags = ops.average(q_t, layout, "q", b_t, packed.clone(), world, backend="triton")
    ops.average(q_r, layout, "q", b_r, packed.clone(), world, backend="torch")
    assert torch.equal(q_t, q_r) and torch.equal(b_t, b_r)
    assert bool((flags.flags & 1).all())
    nonzero = [bool((flags.flags[flags.first[i]:flags.first[i + 1]] & 2).any()) for i in range(layout.num_matrices)]
    assert nonzero == [False] + [True] * (layout.num_matrices - 1)
    b_u = buf.clone()
    ops.unpack_uncompressed(packed * 2, layout, b_u, 0.5, backend="triton")
    assert torch.equal(b_u, buf)
