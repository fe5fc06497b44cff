"""Cross-program races, under the interpreter (issue 24 item 4): every Triton kernel variant and the hooks' steps give
bitwise the same results when each launch runs its programs in reversed or in a seeded shuffled order
(``_program_order``) as in the natural order the interpreter uses otherwise. On a GPU the programs of a launch run in
any order and at once: a result that depends on their order is a race there.

The fixture is shown to work: the orthogonalization of a short factor split over ``APPLY_ROWS`` programs, run in place
(the launcher refuses that combination: ``orthogonalization._in_place_config``; here that guard is bypassed), reads rows other
programs already overwrote, and the check fails (``xfail(strict=True)``: the test fails if it ever passes).
"""

import sys

import pytest
import torch

from _dist import FakeBucket, bucket_numel
from _program_order import OrderDependenceError, assert_order_independent, check_supported, program_order
from bucket_utils import layerwise, make_bucket, seeded_data
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton import ops
from powersgd_triton.layout import BucketLayout

pytest.importorskip("triton")
from powersgd_triton.ops import configs, orthogonalization  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# matrices of rows past one tile, one split and one APPLY_ROWS (P: 40 rows; Q: 40 rows), a one-row one, 1-D gradients
SHAPES = [(40, 12), (30, 40), (1, 9), (12, 12), (9,), (5,)]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
KERNEL = {  # kernel function names of the launches
    "project": "_project_kernel", "project_t": "_project_t_kernel", "reduce": "_reduce_splits_kernel",
    "ortho": "_orthogonalize_kernel", "gram": "_ortho_gram_kernel", "reconstruct": "_reconstruct_kernel",
    "average": "_average_kernel", "segments": "_copy_segments_kernel", "commit": "_commit_factor_kernel",
}

# small tiles: several programs per matrix, and every loop shape (register prefetch, loop-carried prefetch, tl.dot)
PROJECT_CONFIGS = {
    "interpreter": None,
    "small_prefetch": dict(BLOCK_N=16, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=2),
    "carry": dict(BLOCK_N=16, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=1, CARRY=True),
    "dot": dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=True, num_warps=4, num_stages=1),
}
PROJECT_T_CONFIGS = {
    "interpreter": None,
    "split_rows": dict(BLOCK_M=16, BLOCK_K=8, SPLIT_ROWS=20, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=1),
    "prefetch_split": dict(BLOCK_M=128, BLOCK_K=4, SPLIT_ROWS=24, USE_DOT=False, num_warps=4, num_stages=1,
                           PREFETCH=2),
    "dot_split": dict(BLOCK_M=32, BLOCK_K=16, SPLIT_ROWS=16, USE_DOT=True, num_warps=4, num_stages=1),
}
RECONSTRUCT_CONFIGS = {
    "interpreter": None,
    "small_prefetch": dict(BLOCK_N=16, BLOCK_K=16, USE_DOT=False, num_warps=4, num_stages=1, PREFETCH=2),
    "split_cols_carry": dict(BLOCK_N=16, BLOCK_K=16, SPLIT_COLS=16, USE_DOT=False, num_warps=4, num_stages=1,
                             PREFETCH=1, CARRY=True),
    "dot": dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=True, num_warps=4, num_stages=1),
}
# orthogonalize: short factors (one program each), short factors over APPLY_ROWS programs, split factors (Gram launch)
ORTHO_CONFIGS = {
    "interpreter": None,
    "apply_rows": dict(BLOCK=16, SHORT_ROWS=320, GRAM_ROWS=32, SPLIT_ROWS=16, num_warps=4, num_stages=1,
                       APPLY_ROWS=32),
    "split": dict(BLOCK=16, SHORT_ROWS=32, GRAM_ROWS=32, SPLIT_ROWS=16, num_warps=4, num_stages=1),
}


def _bucket(dtype, rng, rank=3, shapes=SHAPES, min_rate=0.5):
    buf, _, grads = make_bucket(shapes, dtype, rng)
    return buf, layerwise(buf, grads, rank, min_rate)


def _randn(n, rng, scale=1.0):
    return torch.randn(n, generator=rng) * scale


def test_fixture_runs_the_orders_it_says():
    """The probe kernel's programs record the order they ran in (``check_supported``), and the natural order is the
    interpreter's own (x outermost, z innermost); an unknown order is refused."""
    check_supported()
    with pytest.raises(ValueError, match="program order"):
        with program_order("sideways"):
            pass


# ----------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("config, dtype", [("interpreter", BF16), ("small_prefetch", F32), ("carry", BF16),
                                           ("dot", F32)], ids=str)
def test_project(config, dtype, rng):
    buf, layout = _bucket(dtype, rng)
    q, err, scale = _randn(layout.q_numel, rng), _randn(layout.e_numel, rng, 0.1), torch.tensor([0.5])
    cfg = PROJECT_CONFIGS[config]

    def run():
        b, e = buf.clone(), err.clone()
        p, p2 = torch.empty(layout.p_numel), torch.empty(layout.p_numel)
        ops.project(b, layout, q, p, e, p2=p2, loss_scale=scale, backend="triton", config=cfg)
        p_plain = torch.empty(layout.p_numel)
        ops.project(buf.clone(), layout, q, p_plain, backend="triton", config=cfg)
        return p, p2, b, e, p_plain

    assert_order_independent(run, expect=[KERNEL["project"]])


@pytest.mark.parametrize("config, dtype", [("interpreter", F16), ("split_rows", F32), ("prefetch_split", BF16),
                                           ("dot_split", F32)], ids=str)
def test_project_t(config, dtype, rng):
    buf, layout = _bucket(dtype, rng)
    p = _randn(layout.p_numel, rng)
    cfg = PROJECT_T_CONFIGS[config]

    def run():
        q, q2 = torch.empty(layout.q_numel), torch.empty(layout.q_numel)
        ops.project_t(buf, layout, p, q, q2=q2, backend="triton", config=cfg)
        return q, q2

    expect = [KERNEL["project_t"]] + ([KERNEL["reduce"]] if cfg and "SPLIT_ROWS" in cfg else [])
    assert_order_independent(run, expect=expect)


@pytest.mark.parametrize("config, dtype", [("heuristic", BF16), ("row_split", F16)], ids=str)
def test_project_t_split_bf16(config, dtype, rng):
    """The split tensor-core path (``SPLIT_BF16``) at rank 8 (R padded to 16), 2-byte gradients: the GPU heuristic's
    config and one over 48-row splits (its fixed-order reduction launch)."""
    cfg = dict(configs.PROJECT_T_SPLIT_CONFIG)
    if config == "row_split":
        cfg = dict(BLOCK_M=32, BLOCK_K=16, SPLIT_ROWS=48, USE_DOT=True, SPLIT_BF16=True, num_warps=4, num_stages=3)
    buf, layout = _bucket(dtype, rng, rank=8, shapes=[(60, 20), (20, 9), (5, 40), (16,)])
    assert configs.split_bf16_dot(cfg, dtype)
    p = _randn(layout.p_numel, rng)

    def run():
        q = torch.empty(layout.q_numel)
        ops.project_t(buf, layout, p, q, backend="triton", config=cfg)
        return (q,)

    assert_order_independent(run, expect=[KERNEL["project_t"]] + ([KERNEL["reduce"]] if config == "row_split" else []))


@pytest.mark.parametrize("kernel", ["project", "project_t", "reconstruct"])
def test_batched_view_with_padding_error(kernel, rng):
    """The batched view (one square matrix, its padding's error memory: ``PAD_ERROR``) with a loss scale."""
    buf, _, _ = make_bucket([(20 * 20 - 7,)], torch.bfloat16, rng)
    layout = BucketLayout.batched(buf.numel(), 4, "cpu", torch.bfloat16)
    err, scale = _randn(layout.e_numel, rng, 0.1), torch.tensor([2.0])
    p, q = _randn(layout.p_numel, rng), _randn(layout.q_numel, rng)
    cfg = {"project": PROJECT_CONFIGS["small_prefetch"], "project_t": PROJECT_T_CONFIGS["split_rows"],
           "reconstruct": RECONSTRUCT_CONFIGS["small_prefetch"]}[kernel]

    def run():
        b, e = buf.clone(), err.clone()
        if kernel == "project":
            out = torch.empty(layout.p_numel)
            ops.project(b, layout, q, out, e, loss_scale=scale, backend="triton", config=cfg)
        elif kernel == "project_t":
            out = torch.empty(layout.q_numel)
            ops.project_t(b, layout, p, out, error=e, loss_scale=scale, backend="triton", config=cfg)
        else:
            out = torch.empty(0)
            ops.reconstruct(b, layout, p, q, 0.5, e, torch.tensor(True), loss_scale=scale, backend="triton",
                            config=cfg)
        return out, b, e

    assert_order_independent(run, expect=[KERNEL[kernel]])


def _orthogonalize_inputs(layout, which, rng):
    """A factor with a dependent column and an all-zero factor (completions read the factor's first rows)."""
    x = _randn(layout.p_numel if which == "p" else layout.q_numel, rng)
    s = max(layout.matrices, key=lambda s: s.n if which == "p" else s.m)
    rows = s.n if which == "p" else s.m
    off = s.p_offset if which == "p" else s.q_offset
    f = x[off : off + rows * s.rank].view(rows, s.rank)
    f[:, 1] = f[:, 0]
    z = layout.matrices[-1]
    zoff, zrows = (z.p_offset, z.n) if which == "p" else (z.q_offset, z.m)
    x[zoff : zoff + zrows * z.rank] = 0.0
    return x


@pytest.mark.parametrize("config, which", [("interpreter", "p"), ("apply_rows", "q"), ("split", "p"), ("split", "q")],
                         ids=str)
def test_orthogonalize(config, which, rng):
    """Out of place and in place (the hooks' P), epsilon 0 and 1e-8; with ``APPLY_ROWS`` in place the launcher drops
    it (the guard the xfail test below bypasses)."""
    buf, layout = _bucket(torch.float32, rng, rank=2)
    x = _orthogonalize_inputs(layout, which, rng)
    cfg = ORTHO_CONFIGS[config]

    def run():
        out = torch.empty_like(x)
        ops.orthogonalize(x, layout, which, 0.0, out=out, backend="triton", config=cfg)
        y = x.clone()
        ops.orthogonalize(y, layout, which, 1e-8, backend="triton", config=cfg)
        return out, y

    expect = [KERNEL["ortho"]] + ([KERNEL["gram"]] if config == "split" else [])
    stats = assert_order_independent(run, expect=expect)
    if config == "split":
        assert stats["natural"].launches[KERNEL["gram"]] == 2  # the Gram launch ran, out of place and in place


def _in_place_config_module():
    """The module whose functions call ``_in_place_config`` (``ops/orthogonalization.py``, or the room it moved to)."""
    return sys.modules[orthogonalization._in_place_config.__module__]


@pytest.mark.xfail(strict=True, raises=OrderDependenceError,
                   reason="in-place APPLY_ROWS: every program reads the whole factor for its Gram while the others "
                          "overwrite their rows (the race the launcher's _in_place_config guard prevents)")
@pytest.mark.parametrize("which", ["p", "q"])
def test_in_place_apply_rows_race_is_caught(which, monkeypatch, rng):
    monkeypatch.setattr(_in_place_config_module(), "_in_place_config", lambda cfg, in_place: cfg)
    buf, layout = _bucket(torch.float32, rng)
    x = _orthogonalize_inputs(layout, which, rng)
    cfg = ORTHO_CONFIGS["apply_rows"]
    tall = max(s.n if which == "p" else s.m for s in layout.matrices)
    programs = sum(-(-(s.n if which == "p" else s.m) // cfg["APPLY_ROWS"]) for s in layout.matrices)
    assert tall > cfg["APPLY_ROWS"] and programs > layout.num_matrices

    def run():
        y = x.clone()
        ops.orthogonalize(y, layout, which, backend="triton", config=cfg)
        return (y,)

    with program_order("natural") as stats:
        run()
    # the guard is bypassed: the in-place launch has one program per APPLY_ROWS rows, not one per factor
    assert stats.launches == {KERNEL["ortho"]: 1} and stats.programs[KERNEL["ortho"]] == [programs]
    assert_order_independent(run, expect=[KERNEL["ortho"]])


@pytest.mark.parametrize("config, mode, dtype", [("interpreter", "error_flag", BF16), ("small_prefetch", "local_p", F32),
                                                 ("split_cols_carry", "loss_scale", BF16), ("dot", "local_q", F32)],
                         ids=str)
def test_reconstruct(config, mode, dtype, rng):
    """Error update with the step flag, the alternating hook's local residuals (``local_p``/``local_q``), the loss
    scale; and the plain reconstruct."""
    buf, layout = _bucket(dtype, rng)
    p, q, err = _randn(layout.p_numel, rng), _randn(layout.q_numel, rng), _randn(layout.e_numel, rng, 0.1)
    cfg = RECONSTRUCT_CONFIGS[config]
    kw = {}
    if mode == "local_p":
        kw["local_p"] = _randn(layout.p_numel, rng)
    elif mode == "local_q":
        kw["local_q"] = _randn(layout.q_numel, rng)
    elif mode == "loss_scale":
        kw["loss_scale"] = torch.tensor([4.0])

    def run():
        b, e = buf.clone(), err.clone()
        ops.reconstruct(b, layout, p, q, 0.25, e, torch.tensor(True), backend="triton", config=cfg, **kw)
        plain = buf.clone()
        ops.reconstruct(plain, layout, p, q, 0.25, backend="triton", config=cfg)
        return b, e, plain

    assert_order_independent(run, expect=[KERNEL["reconstruct"]])


@pytest.mark.parametrize("which, packed", [("p", True), ("q", False)], ids=["p-packed", "q-in_place"])
def test_average_then_reconstruct_with_commit(which, packed, rng):
    """average (its step flags per chunk, the uncompressed gradients packed or in place) feeding reconstruct's
    warm-start commit; one matrix's factor is all zero (kept), and a non-finite step keeps everything."""
    shapes = [(40, 12), (9,), (30, 40), (5,), (12, 12)] if packed else [(40, 12), (30, 40), (300,)]
    buf, layout = _bucket(torch.float32, rng, shapes=shapes, min_rate=2)
    assert (len(layout.uncompressed) > 1) == packed
    numel = layout.p_numel if which == "p" else layout.q_numel
    factor, kept = _randn(numel, rng), _randn(numel, rng)
    z = layout.matrices[-1]
    zoff, zn = (z.p_offset, z.n * z.rank) if which == "p" else (z.q_offset, z.m * z.rank)
    factor[zoff : zoff + zn] = 0.0
    other = _randn(layout.q_numel if which == "p" else layout.p_numel, rng)
    unc = _randn(layout.uncompressed_numel, rng) if packed else None
    err = _randn(layout.e_numel, rng, 0.1)

    def one(bad):
        b, f, k, e = buf.clone(), factor.clone(), kept.clone(), err.clone()
        u = unc.clone() if packed else None
        if bad:
            (u if packed else b)[-1] = float("inf")
        flags = ops.average(f, layout, which, b, u, 2, backend="triton")
        p, q = (f, other) if which == "p" else (other, f)
        ops.reconstruct(b, layout, p, q, 1.0, e, flags, commit=(which, k), backend="triton")
        return [f, b, k, e, flags.flags]

    assert_order_independent(lambda: one(False) + one(True), expect=[KERNEL["average"], KERNEL["reconstruct"]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_copy_segments(dtype, rng):
    shapes = [(3000,), (20, 30), (7,), (2, 2), (40, 50), (1500,), (5,)]  # segments longer than one block, too
    buf, layout = _bucket(dtype, rng, rank=2, shapes=shapes, min_rate=2)
    assert len(layout.uncompressed) >= 3
    new = _randn(layout.uncompressed_numel, rng)

    def run():
        packed = torch.empty(layout.uncompressed_numel)
        ops.pack_uncompressed(buf, layout, packed, backend="triton")
        b = buf.clone()
        ops.unpack_uncompressed(new, layout, b, 0.5, backend="triton")
        return packed, b

    assert_order_independent(run, expect=[KERNEL["segments"]])


@pytest.mark.parametrize("which", ["p", "q"])
def test_commit_factor(which, rng):
    buf, layout = _bucket(torch.float32, rng)
    numel = layout.p_numel if which == "p" else layout.q_numel
    new, kept = _randn(numel, rng), _randn(numel, rng)
    z = layout.matrices[1]
    zoff, zn = (z.p_offset, z.n * z.rank) if which == "p" else (z.q_offset, z.m * z.rank)
    new[zoff : zoff + zn] = 0.0

    def run():
        k = kept.clone()
        ops.commit_factor(new, k, layout, which, torch.tensor(True), backend="triton")
        return (k,)

    assert_order_independent(run, expect=[KERNEL["commit"]])


# ------------------------------------------------------------------------------------------------------- hooks
# bucket 0's 1-D gradient and small conv are apart: packed for their all-reduce (copy_segments; powerSGD_hook: by
# project's launch)
HOOK_BUCKETS = [(0, False, [(8,), (40, 12), (6, 2, 3, 3), (36, 10)]), (1, True, [(36, 10), (10,), (10, 36)])]
HOOKS = {"powerSGD": powerSGD_hook, "batched": batched_powerSGD_hook, "alternating": alternating_powerSGD_hook}
# the hooks' untuned configs under the interpreter (project and reconstruct: the interpreter's, one program per
# matrix here), with the factors longer than 16 rows split (the Gram launch) and project_t's rows split (the reduction
# launch)
HOOK_CONFIGS = {
    "project_t": dict(BLOCK_M=32, BLOCK_K=16, SPLIT_ROWS=16, USE_DOT=False, num_warps=4, num_stages=1),
    "orthogonalize": dict(BLOCK=16, SHORT_ROWS=16, GRAM_ROWS=16, SPLIT_ROWS=16, num_warps=4, num_stages=1),
}


@pytest.mark.parametrize("hook_name, chain", [("powerSGD", True), ("batched", False), ("alternating", False)], ids=str)
def test_hook_steps(hook_name, chain, world1, monkeypatch, rng):
    """Four steps (two uncompressed, two compressed with error feedback and warm start) of each hook on two fake
    buckets, Triton backend, in the in-body schedule or the ``then()`` chain (NCCL's): outputs bitwise the same in
    every program order."""
    from powersgd_triton.hooks import driver as _step

    for kernel, cfg in HOOK_CONFIGS.items():
        monkeypatch.setitem(configs.INTERPRETER_CONFIGS, kernel, cfg)
    monkeypatch.setattr(_step.OPTIONS, "callback_chain", chain)
    hook = HOOKS[hook_name]
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))

    def run():
        state = PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=2, backend="triton")
        outs = []
        for step in range(4):
            for index, is_last, shapes in HOOK_BUCKETS:
                data = seeded_data(seed, step, 0, index, bucket_numel(shapes))
                outs.append(hook(state, FakeBucket(data, shapes, index, is_last)).wait().clone())
        return outs

    expect = ["project_t", "ortho", "gram"]
    if hook_name != "batched":  # the batched view is one matrix: one tile of the interpreter's configs
        expect += ["project", "reconstruct", "average"]
    if hook_name == "powerSGD":  # bucket 0's pack: project's pack programs (project(..., packed=)), no launch of its own
        expect.append("reduce")
    if hook_name == "alternating":
        expect.append("segments")
    expect = [KERNEL[k] for k in expect]
    assert_order_independent(run, expect=expect)
