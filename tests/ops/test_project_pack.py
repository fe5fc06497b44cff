"""project's launch with the pack of the uncompressed gradients (``project(..., packed=)``, issue 39: one launch
less per compressed bucket step), in the Triton interpreter: the packed buffer is the torch backend's pack bit for
bit, P and the bucket (M + E written back) are the launch's without the pack bit for bit and the torch backend's
within float32 rounding; nothing is written outside the packed buffer. Aligned layouts (chunks at multiples of 16
bytes: the pack programs' 16-byte path) and ragged ones, segments shorter and longer than a row of the pack tile
(``SEGMENT_BLOCK``) and than a chunk (``SEGMENT_BLOCK x SEGMENT_ITERS``)."""

import pytest
import torch

from bucket_utils import guarded, guards_intact, layerwise, make_bucket, rel_err
from powersgd_triton import ops
from powersgd_triton.ops import segments

pytest.importorskip("triton")
from powersgd_triton.ops import projection  # noqa: E402 - needs triton

# uncompressed: 8, 24, 264, 1032, 2056 and 16 elements between matrices (all multiples of 8: 16-byte chunks)
ALIGNED = [(24, 16), (8,), (40, 32), (24,), (264,), (16, 3, 3, 8), (1032,), (37, 128), (2056,), (16,)]
# uncompressed: 7, 300 + 5, 1500 + 3, 11 (offsets and counts of no alignment)
RAGGED = [(7,), (33, 65), (300,), (5,), (17, 40), (1500,), (3,), (20, 129), (11,)]
CONFIGS = [dict(BLOCK_N=8, BLOCK_K=16, USE_DOT=False), dict(BLOCK_N=4, BLOCK_K=32, USE_DOT=False, num_warps=8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shapes", ["aligned", "ragged"])
@pytest.mark.parametrize("with_error", [False, True], ids=["plain", "error"])
@pytest.mark.parametrize("config", [0, 1])
def test_project_packs(dtype, shapes, with_error, config, rng):
    buf, whole, grads = make_bucket(ALIGNED if shapes == "aligned" else RAGGED, dtype, rng)
    layout = layerwise(buf, grads, 4, min_rate=2.0)
    cfg = CONFIGS[config]
    assert len(layout.uncompressed) >= 4 and layout.num_matrices >= 3
    assert segments.chunk_alignment(layout) == (segments.CHUNK_ALIGN if shapes == "aligned" else 0)
    q = torch.randn(layout.q_numel, generator=rng)
    err = torch.randn(layout.e_numel, generator=rng) * 0.3 if with_error else None

    def run(backend, pack):
        b, e = buf.clone(), None if err is None else err.clone()
        p, p_whole = guarded(layout.p_numel)
        packed, packed_whole = guarded(layout.uncompressed_numel, dtype) if pack else (None, None)
        ops.project(b, layout, q, p, e, packed=packed, backend=backend, config=cfg if backend == "triton" else None)
        assert guards_intact(p_whole, layout.p_numel)
        if pack:
            assert guards_intact(packed_whole, layout.uncompressed_numel)
        return b, p, e, packed

    b_f, p_f, e_f, packed_f = run("triton", True)
    b_t, p_t, e_t, _ = run("triton", False)
    b_r, p_r, _, packed_r = run("torch", True)
    assert torch.equal(packed_f, packed_r)  # the torch backend's pack: index_select
    assert torch.equal(packed_f, layout.gather_uncompressed(buf))
    assert torch.equal(p_f, p_t) and torch.equal(b_f, b_t)  # the pack programs change nothing of the projection
    assert rel_err(p_f, p_r) < 1e-5
    if with_error:
        assert torch.equal(e_f, err)  # project reads the error memory, never writes it
        assert rel_err(b_f.float(), b_r.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    else:
        assert torch.equal(b_f, buf)
    # the launch: project's tiles, then one pack program per num_warps chunks (an empty chunk pads the last)
    launch = [plan for key, plan in layout._tiles.items() if isinstance(key, tuple) and key[0] == "launch:project"
              and key[-1]]
    assert len(launch) == 1
    kw = launch[0][0].kwargs
    warps = cfg.get("num_warps", 4)
    assert kw["PACK"] == warps and kw["PACK_ALIGN"] == segments.chunk_alignment(layout)
    chunks = sum(-(-n // (segments.SEGMENT_BLOCK * segments.SEGMENT_ITERS)) for _, n in layout.uncompressed)
    project_tiles = sum(-(-s.n // cfg["BLOCK_N"]) for s in layout.matrices)
    assert launch[0][0].grid == (project_tiles + -(-chunks // warps),)


def test_project_packs_other_dtype_and_no_matrix(rng):
    """A float32 packed buffer of a bf16 bucket (upcast, as pack_uncompressed does); a bucket with no matrix to
    project still packs (pack_uncompressed)."""
    buf, _, grads = make_bucket(RAGGED, torch.bfloat16, rng)
    layout = layerwise(buf, grads, 4, min_rate=2.0)
    q, p = torch.randn(layout.q_numel, generator=rng), torch.empty(layout.p_numel)
    packed = torch.full((layout.uncompressed_numel,), float("nan"))
    ops.project(buf, layout, q, p, packed=packed, backend="triton")
    assert torch.equal(packed, layout.gather_uncompressed(buf).float())
    buf, _, grads = make_bucket([(5,), (7,)], torch.float32, rng)
    layout = layerwise(buf, grads, 4, min_rate=2.0)
    assert layout.num_matrices == 0
    packed = torch.full((layout.uncompressed_numel,), float("nan"))
    ops.project(buf, layout, torch.empty(0), torch.empty(0), packed=packed, backend="triton")
    assert torch.equal(packed, buf)
    with pytest.raises(ValueError, match="packed"):
        ops.project(buf, layout, torch.empty(0), torch.empty(0), packed=torch.empty(3), backend="triton")
