"""bfloat16 stores round like ``torch.Tensor.to(torch.bfloat16)`` on explicit bit patterns, NaN payloads included.

NVIDIA arithmetic produces the NaN ``0x7FFFFFFF`` (``inf - inf``, ``0 * inf``) and ``0xFFFFFFFF``; the interpreter
produces ``0x7FC00000``. A round-to-nearest-even add on the bits (``bits + 0x7FFF + lsb``) carries a NaN payload into
the exponent: ``0x7FFFFFFF`` became ``0x8000`` (-0.0), ``0xFFFFFFFF`` +0.0 and ``0x7F800001`` inf, so a non-finite
bfloat16 step looked finite. Every store path is checked: the rounding itself (a probe kernel), ``project`` (M + E),
``reconstruct`` (P·Qᵀ), the segment copies and the average launch.
"""

import pytest
import torch

from bucket_utils import layerwise, make_bucket
from powersgd_triton import ops

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from powersgd_triton.ops.common import _cast_for_store  # noqa: E402

PATTERNS = [
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F80FFFF,  # NaNs
    0x7F800000, 0xFF800000,  # +-inf
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # largest finite: rounds up to inf; tie to inf; rounds down
    0x3F808000, 0x3F818000, 0x3F80C000, 0x3F804000, 0xBF818000,  # ties to even (down, up), above / below the tie
    0x00000001, 0x00008000, 0x00018000, 0x807FFFFF, 0x00400000, 0x80000001,  # subnormals and their ties
    0x00000000, 0x80000000, 0x3F800000, 0x00800000,  # zeros, 1.0, smallest normal
]


def _as_float(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _check(got_bf16: torch.Tensor, expect_bf16: torch.Tensor, bits=None):
    """Bits equal where torch's result is not NaN; NaN (same sign) where it is: torch's own NaN bits differ between
    its scalar (0x7FC0) and vectorized (0xFFFF) code, any quiet NaN is right."""
    g = got_bf16.view(torch.int16).to(torch.int32) & 0xFFFF
    e = expect_bf16.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = torch.isnan(expect_bf16.float())
    assert torch.equal(torch.isnan(got_bf16.float()), nan), (bits, [hex(v) for v in g.tolist()])
    assert torch.equal(g[~nan], e[~nan]), [(hex(b), hex(x), hex(y)) for b, x, y in zip(bits or [0] * len(g), g.tolist(), e.tolist()) if x != y]
    if bits is not None:
        sign = torch.tensor([(b >> 31) & 1 for b in bits], dtype=torch.int32)
        assert torch.equal((g[nan] >> 15) & 1, sign[nan]), "a NaN changed sign"


@triton.jit
def _round_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0).to(tl.float32, bitcast=True)
    tl.store(dst_ptr + offs, _cast_for_store(x, dst_ptr), mask=offs < n)


def test_cast_for_store_bit_patterns(rng):
    random_bits = torch.randint(0, 2**32, (4000,), generator=rng, dtype=torch.int64).tolist()
    bits = PATTERNS + random_bits
    src = torch.tensor(bits, dtype=torch.int64).to(torch.int32)
    dst = torch.empty(len(bits), dtype=torch.bfloat16)
    _round_kernel[(1,)](src, dst, len(bits), BLOCK=triton.next_power_of_2(len(bits)))
    _check(dst, src.view(torch.float32).to(torch.bfloat16), bits)


@pytest.mark.parametrize("payload", [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7F800000, 0xFF800000])
def test_store_paths_keep_non_finite_bf16(payload, rng):
    """project (M + E), reconstruct (P·Qᵀ), pack/unpack and average write non-finite where torch would."""
    shapes = [(24, 40), (24,), (16, 48), (7,)]
    buf, _, grads = make_bucket(shapes, torch.bfloat16, rng)
    layout = layerwise(buf, grads, 1, min_rate=2)
    bad = _as_float([payload])[0]
    # project: M + E with a non-finite E at a few places
    err = torch.randn(layout.e_numel, generator=rng) * 0.1
    err[::97] = bad
    q = torch.randn(layout.q_numel, generator=rng)
    p = torch.empty(layout.p_numel)
    expect = buf.clone()
    for s in layout.matrices:
        seg = slice(s.offset, s.offset + s.numel)
        expect[seg] = (buf[seg].float() + err[s.e_offset : s.e_offset + s.numel]).to(torch.bfloat16)
    ops.project(buf, layout, q, p, err, backend="triton")
    _check(buf, expect)
    assert torch.isnan(expect).any() or torch.isinf(expect).any()
    # reconstruct: a non-finite P row gives non-finite output rows
    p = torch.randn(layout.p_numel, generator=rng)
    p[3] = bad
    q = torch.randn(layout.q_numel, generator=rng)
    ops.reconstruct(buf, layout, p, q, 1.0, backend="triton")
    for s in layout.matrices:
        pi = p[s.p_offset : s.p_offset + s.n * s.rank].view(s.n, s.rank)
        qi = q[s.q_offset : s.q_offset + s.m * s.rank].view(s.m, s.rank)
        want = (pi @ qi.t()).reshape(-1).to(torch.bfloat16)
        got = buf[s.offset : s.offset + s.numel]
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    # segment copies: unpack float32 values (scale 1) into the bf16 bucket, pack them back
    values = torch.randn(layout.uncompressed_numel, generator=rng)
    values[::5] = bad
    ops.unpack_uncompressed(values, layout, buf, backend="triton")
    got = torch.cat([buf[o : o + n] for o, n in layout.uncompressed])
    _check(got, values.to(torch.bfloat16))
    packed = torch.empty(layout.uncompressed_numel, dtype=torch.bfloat16)
    ops.pack_uncompressed(buf, layout, packed, backend="triton")
    _check(packed, values.to(torch.bfloat16))
    # average: the factor (float32) and the uncompressed gradients divided by the world size
    factor = torch.randn(layout.q_numel, generator=rng)
    factor[1] = bad
    want_f = factor / 2
    flags = ops.average(factor, layout, "q", buf, packed, 2, backend="triton")
    assert torch.equal(torch.isnan(factor), torch.isnan(want_f)) and torch.equal(factor[~torch.isnan(want_f)], want_f[~torch.isnan(want_f)])
    got = torch.cat([buf[o : o + n] for o, n in layout.uncompressed])
    _check(got, (packed.float() / 2).to(torch.bfloat16))
    assert not bool((flags.flags & 1).all())  # the step is not finite
