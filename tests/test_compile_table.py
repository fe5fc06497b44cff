"""The kernels' heuristic configs for sm_90: registers, spills and compile time, without a GPU.

Compiled ahead of time (``aot_compile.compile_aot``, a fresh Triton cache so nothing is read back) as Triton's JIT
compiles the launch on a GPU: every pointer argument 16-byte aligned (what the hooks pass: each buffer an allocation of
its own) marked ``tt.divisibility = 16``, integers specialized as the JIT does (``aot_compile.jit_attributes``;
``tests/test_aot_jit_match.py`` checks the binaries against the JIT's own under a fake GPU driver), in a pool of 2
processes; registers and spill bytes come from ``ptxas -v`` (``tools.aot.resource_usage``). The table
(``aot_compile.table_jobs``): every kernel function (the launches: project, project_t and its reducer, reconstruct,
orthogonalize and its Gram launch, copy_segments, average, commit_factor) x every feature variant it is launched with
x fp32 / bf16 / fp16 x the padded ranks 1, 2, 4, 8, 16, 32 (every rank 1..32 compiles as one of them), each with the
GPU heuristic's config for that rank, dtype and view (the batched view for project_t's ``PADDED``/``PAD_ERROR``
variants), one compile per distinct binary: 702 under triton 3.9 (546 on the masked path, 151 on the aligned
layout's ``ALIGN`` path, 5 more of average's power-of-two reciprocal).

Targets: spill bytes at most :data:`SPILL_BUDGET` (none) in every binary; <= 128 registers per thread at ranks <= 8
in each streaming kernel's (project, project_t, reconstruct) largest variant; every compile < 15 s (CPU seconds of
the compiling process and its ptxas, so a loaded machine does not fail it). The quick tier compiles a representative
subset (the script's ``quick``: each kernel function's largest variant in bf16 at the binding ranks 8 and 32, once
for the rank-independent ones; orthogonalize and its Gram launch at 8 and 16, where triton 3.6 spilled before its
configs were keyed; project_t's batched padding-error variant at 1-4 in fp32); the whole table is the slow tier's
(``.ci/run``, triton 3.9) and the compat tier's (``.ci/compat``: triton 3.6; 3.4 and 3.8 without fp16).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SPILL_BUDGET = 0  # bytes of local memory a binary may spill to (ptxas -v "bytes spill stores"): none

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    from concurrent.futures import ProcessPoolExecutor
    import torch
    from tools import aot_compile as A
    from tools import aot
    from powersgd_triton.ops.configs import STREAMING_KERNELS

    def job(args):
        kernel, cfg, dtype, rank, variant = args
        # the register target is the streaming kernels' (each one's largest variant, the most code)
        row = dict(kernel=kernel, rank=rank, dtype=str(dtype)[6:], config=cfg, variant=variant,
                   largest=kernel in STREAMING_KERNELS
                   and variant == {k: v for k, v in A.variants(kernel)[0].items() if k != "split"})

        def cpu():  # this worker's CPU seconds and its finished children's (ptxas): load-independent
            own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

        t0, c0 = time.perf_counter(), cpu()
        try:
            c = A.compile_aot(kernel, cfg, dtype, rank, 90, variant)
            seconds, wall = cpu() - c0, time.perf_counter() - t0
            u = aot.resource_usage(c, 90)
            row.update(ok=True, seconds=seconds, wall_seconds=wall, registers=u["registers"],
                       spill_bytes=u["spill_bytes"], blocks_per_sm=u["blocks_per_sm"])
        except Exception as e:
            row.update(ok=False, error=repr(e)[:2000])
        return row

    if __name__ == "__main__":
        which = sys.argv[1]
        jobs = A.table_jobs()
        if which == "light":
            jobs = [j for j in jobs if j[2] != torch.float16]
        if which == "quick":
            def largest(j):
                return j[4] == {k: v for k, v in A.variants(j[0])[0].items() if k != "split"}

            def quick(j):
                kernel, cfg, dtype, rank, variant = j
                batched_t = kernel == "project_t" and (variant.get("PADDED") or variant.get("PAD_ERROR"))
                return ((largest(j) and dtype == torch.bfloat16 and rank in (8, 32))
                        or (kernel in ("orthogonalize", "orthogonalize_gram") and rank in (8, 16))
                        or (batched_t and variant.get("LOSS_SCALE") and not variant.get("wire") and rank <= 4
                            and dtype == torch.float32))
            firsts = {}  # and every kernel function's largest variant once (the rank-independent helpers)
            for j in jobs:
                if largest(j):
                    firsts.setdefault(j[0], j)
            jobs = [j for j in jobs if quick(j) or firsts.get(j[0]) is j]
        with ProcessPoolExecutor(max_workers=2) as pool:
            json.dump(list(pool.map(job, jobs)), sys.stdout)
    """
)


def _older_triton_exception(row):
    """A known exception under an older Triton: project_t's split tensor-core config (PROJECT_T_SPLIT_CONFIG,
    2-byte gradients at R >= 8, no maxnreg) compiles on sm_90 to 218-226 registers per thread at R 8 under triton
    3.4 (2 blocks of 4 warps per SM instead of 4), and to 147 in fp16's second-Q variant under triton 3.6 (3 blocks;
    bf16 128; capped at 128 it spills 152 bytes), no spills."""
    import triton

    from powersgd_triton.compat import versions as _compat

    version = _compat.version_tuple(triton.__version__)[:2]
    return (row["kernel"] == "project_t" and row["config"].get("SPLIT_BF16") and row["spill_bytes"] == 0
            and (version <= (3, 4) or (version <= (3, 6) and row["dtype"] == "float16" and row["registers"] <= 147)))


# Triton 3.4's orthogonalize at padded rank 32 (float64 Gram products broadcast and summed: 3.4's tl.dot takes no
# float64): spills at every tile tried on the sm_90 compile as the JIT compiles it (16-64 rows, 4-16 warps: 344-9364
# bytes; its heuristic, compat.tiles' 16 rows at 8 warps: 344). Allowed up to this many bytes there, nowhere else.
TRITON_34_ORTHO_R32_SPILL = 512


def _spill_allowed(row):
    """The spill bytes a binary may have: :data:`SPILL_BUDGET`, or under triton <= 3.4 orthogonalize's (not its Gram
    launch's) at R 32, :data:`TRITON_34_ORTHO_R32_SPILL`."""
    import triton

    from powersgd_triton.compat import versions as _compat

    if (_compat.version_tuple(triton.__version__)[:2] <= (3, 4) and row["kernel"] == "orthogonalize"
            and row["rank"] == 32):
        return TRITON_34_ORTHO_R32_SPILL
    return SPILL_BUDGET


def _table(tmp_path, which):
    script = tmp_path / "table.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, env=env,
                         timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    print("\nkernel             R dtype     registers spills blocks/SM compile_s (CPU)  variant  config")
    for r in rows:
        if r["ok"]:
            print(f"{r['kernel']:18s} {r['rank']:2d} {r['dtype']:9s} {r['registers']:9d} {r['spill_bytes']:6d} "
                  f"{r['blocks_per_sm']:9d} {r['seconds']:9.1f}  {r['variant']}  {r['config']}")
    return rows


def _check(rows):
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    spilled = [r for r in rows if r["spill_bytes"] > _spill_allowed(r)]
    assert not spilled, "spills above the budget of %d bytes:\n" % SPILL_BUDGET + "\n".join(
        f"{r['kernel']} R {r['rank']} {r['dtype']} {r['variant']}: {r['spill_bytes']} B, {r['registers']} registers, "
        f"config {r['config']}" for r in spilled)
    heavy = [r for r in rows if r["largest"] and r["rank"] <= 8 and r["registers"] > 128
             and not _older_triton_exception(r)]
    assert not heavy, heavy
    slowest = max(rows, key=lambda r: r["seconds"])
    print(f"{len(rows)} binaries; slowest compile: {slowest['kernel']} R={slowest['rank']} {slowest['seconds']:.1f} s")
    assert slowest["seconds"] < 15.0, slowest


@pytest.mark.timeout(900)
def test_compile_table_representative_subset(tmp_path):
    """The quick tier's part of the table: each kernel's largest variant in bf16 at ranks 8 and 32 (registers grow
    with R: 8 binds "<= 128 registers at ranks <= 8", 32 "no spills"; the rank-independent helpers once),
    orthogonalize and its Gram launch at 8 and 16, project_t's batched padding-error variant at 1, 2 and 4 in fp32."""
    rows = _table(tmp_path, "quick")
    assert {r["kernel"] for r in rows} == {"project", "project_t", "reconstruct", "orthogonalize", "orthogonalize_gram",
                                           "reduce_splits", "copy_segments", "average", "commit_factor"}, rows
    _check(rows)


@pytest.mark.slow  # the slow tier (triton 3.9) and .ci/compat (3.4, 3.6, 3.8): ~702 compiles, minutes on 2 cores
@pytest.mark.timeout(3000)
def test_compile_table_every_variant_dtype_rank(tmp_path):
    """The whole table: every kernel function x variant x fp32/bf16/fp16 x padded rank 1-32, spills within the
    budget, the largest variants' registers, compile times. ``PSGD_COMPILE_TABLE=light`` (the compat tier's light
    pairs, triton 3.4 and 3.8): fp32 and bf16 only, two thirds of the binaries (fp16 takes bf16's 2-byte paths; the
    slow tier's triton 3.9 and the GPU image's 3.6 compile it)."""
    light = os.environ.get("PSGD_COMPILE_TABLE", "all") == "light"
    rows = _table(tmp_path, "light" if light else "all")
    dtypes = {"float32", "bfloat16"} if light else {"float32", "bfloat16", "float16"}
    assert len(rows) >= (260 if light else 400) and {r["dtype"] for r in rows} == dtypes
    assert {r["rank"] for r in rows} == {1, 2, 4, 8, 16, 32}
    _check(rows)


WIRE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from concurrent.futures import ProcessPoolExecutor
    import torch
    from powersgd_triton.ops import configs, kernels
    from powersgd_triton.layout import KERNELS
    from tools import aot_compile

    class _Layout:
        def __init__(self, r):
            self.max_rank = r

    def job(args):
        kernel, variant = args
        tuned = {"reduce_splits": "project_t"}.get(kernel, kernel)
        cfg = configs.heuristic_config(tuned, _Layout(4), torch.bfloat16, 132) if tuned in KERNELS else {}
        try:
            c = aot_compile.compile_aot(kernel, cfg, torch.bfloat16, 4, 90, variant)
            return dict(ok=True, kernel=kernel, variant=variant, shared=c.metadata.shared)
        except Exception as e:
            return dict(ok=False, kernel=kernel, variant=variant, config=cfg, error=repr(e)[:2000])

    if __name__ == "__main__":
        jobs = [(k, v) for k in kernels.KERNEL_FUNCTIONS for v in aot_compile.variants(k) if v.get("wire")]
        with ProcessPoolExecutor(max_workers=2) as pool:
            json.dump(list(pool.map(job, jobs)), sys.stdout)
    """
)


@pytest.mark.timeout(900)
def test_factors_in_the_communication_dtype_compile_for_sm90(tmp_path):
    """The launches that write or read P or Q (or the packed uncompressed gradients) in a bfloat16 all-reduce buffer
    (``variants(...)``'s ``wire``: project, project_t and its reducer, average, copy_segments) compile for sm_90
    under the installed Triton (the compat tier runs
    this under each supported one: triton 3.6 cannot compile a float64 ``tl.dot`` of a 16-bit load, which is why
    orthogonalize reads a float32 copy of P)."""
    script = tmp_path / "wire.py"
    script.write_text(WIRE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert {r["kernel"] for r in rows} == {"project", "project_t", "reduce_splits", "average", "copy_segments"}, rows
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
