"""Every kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100/H200) on this CPU-only machine.

The interpreter accepts code the GPU compiler rejects (dot sizes, shared memory, types), so the kernels are compiled
to cubins here, each with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` through
``aot_compile.compile_aot`` (in a subprocess: under TRITON_INTERPRET=1 the kernels are interpreted functions).

* The default run compiles each kernel once per target: its largest feature variant (the most code,
  ``aot_compile.variants(kernel)[0]``) in bfloat16 (the longest store path) at rank 4 with its heuristic config, and
  the three matmul kernels once more at rank 32, where the heuristic takes the ``tl.dot`` path. 2 processes,
  about a minute on 2 cores.
* The full matrix (``-m aot_matrix``: every feature variant x {fp32, fp16, bf16 at rank 4; bf16 at ranks 1 and 32},
  ~210 compiles, several minutes) is the same check for every combination the launchers use; the autotuner's
  candidates are compiled by tests/test_autotune_aot.py (also ``aot_matrix``).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _deadline import scaled

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
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
        kernel, dtype_name, rank, variant, arch = args
        dtype = getattr(torch, dtype_name)
        # the reducer runs with project_t's config, the Gram launch of split factors with orthogonalize's
        tuned = {"reduce_splits": "project_t", "orthogonalize_gram": "orthogonalize"}.get(kernel, kernel)
        cfg = configs.heuristic_config(tuned, _Layout(rank), dtype) if tuned in KERNELS else {}
        try:
            c = aot_compile.compile_aot(kernel, cfg, dtype, rank, arch, variant)
            return dict(ok=True, kernel=kernel, dtype=dtype_name, rank=rank, arch=arch, variant=variant,
                        use_dot=bool(cfg.get("USE_DOT")), shared=c.metadata.shared)
        except Exception as e:
            return dict(ok=False, kernel=kernel, dtype=dtype_name, rank=rank, arch=arch, variant=variant,
                        config=cfg, error=repr(e)[:2000])

    def plan(which):
        archs = (80, 90)
        if which == "default":  # each kernel once per target (its largest variant), the tl.dot path once more
            jobs = [(k, "bfloat16", 4, aot_compile.variants(k)[0], a) for k in kernels.KERNEL_FUNCTIONS for a in archs]
            jobs += [(k, "bfloat16", 32, aot_compile.variants(k)[0], a) for k in configs.STREAMING_KERNELS for a in archs]
            return jobs
        # the full matrix: every dtype at rank 4; the rank extremes (1: smallest tiles, 32: tl.dot) in bfloat16
        cases = [("float32", 4), ("float16", 4), ("bfloat16", 4), ("bfloat16", 1), ("bfloat16", 32)]
        jobs = [(k, d, r, v, a) for k in KERNELS for d, r in cases for v in aot_compile.variants(k) for a in archs]
        jobs += [("copy_segments", d, 4, v, a) for d in ("float32", "bfloat16") for v in aot_compile.variants("copy_segments")
                 for a in archs]
        jobs += [(k, "float32", 4, v, a) for k in ("commit_factor", "average", "reduce_splits")
                 for v in aot_compile.variants(k) for a in archs]
        return jobs

    if __name__ == "__main__":
        jobs = plan(sys.argv[1])
        with ProcessPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(job, jobs))
        json.dump(results, sys.stdout)
    """
)


def _compile(tmp_path, which):
    script = tmp_path / "aot.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # every kernel really compiles
    out = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, env=env, timeout=scaled(880))
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout)
    failures = [r for r in results if not r["ok"]]
    assert not failures, json.dumps(failures[:5], indent=1)
    assert {r["arch"] for r in results} == {80, 90}
    # shared memory must fit an A100 (164 KiB) and an H100/H200 (228 KiB) block
    assert max(r["shared"] for r in results) <= 164 * 1024
    return results


@pytest.mark.timeout(900)
def test_each_kernel_compiles_once_for_sm80_and_sm90(tmp_path):
    from powersgd_triton.ops import configs, kernels
    from tools import aot_compile

    results = _compile(tmp_path, "default")
    compiled = {(r["kernel"], r["arch"]) for r in results}
    assert compiled == {(k, a) for k in kernels.KERNEL_FUNCTIONS for a in (80, 90)}, compiled
    # the matmul kernels' two paths: broadcast-multiply at rank 4, tl.dot at rank 32, on both targets
    paths = {(r["kernel"], r["arch"], r["use_dot"]) for r in results if r["kernel"] in configs.STREAMING_KERNELS}
    assert paths == {(k, a, d) for k in configs.STREAMING_KERNELS for a in (80, 90) for d in (False, True)}, paths


@pytest.mark.aot_matrix
@pytest.mark.timeout(900)
def test_every_variant_dtype_and_rank_compiles_for_sm80_and_sm90(tmp_path):
    from powersgd_triton.layout import KERNELS
    from tools import aot_compile

    results = _compile(tmp_path, "matrix")
    assert len(results) >= 4 * 5 * 2
    for k in KERNELS:
        got = {json.dumps(r["variant"], sort_keys=True) for r in results if r["kernel"] == k}
        assert got == {json.dumps(v, sort_keys=True) for v in aot_compile.variants(k)}, k
