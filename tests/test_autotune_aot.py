"""Every autotuner candidate config compiles ahead of time for sm_80 and sm_90 (no GPU needed).

Runs ``python -m tools.aot`` in a subprocess with ``TRITON_INTERPRET`` unset (the tests' process
has interpreted kernels) and a fresh ``TRITON_CACHE_DIR`` (so every kernel really compiles), on 2 processes:
bf16, rank 4 (broadcast-multiply path), 8 (both paths offered; the heuristic's own tile at ranks 5-8) and 16
(``tl.dot`` path) for the three matmul kernels, rank 4 for orthogonalize (every rank's candidates are a subset of
rank 4's; its compile time hardly grows with R: see the slow test). Each config also gets the heuristic config of its
rank. About 300 compilations, 3-4 minutes on 2 shared cores: part of the full compile matrix (``-m aot_matrix``); the
default run compiles each kernel once per target (tests/test_aot_compile.py).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from _deadline import scaled

from powersgd_triton.layout import KERNELS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_aot(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=REPO, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), TRITON_DEFAULT_FP_FUSION="1")
    out_json = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.aot", "--jobs", "2", "--dtypes", "bf16", "--archs", "80", "90",
         "--json", str(out_json), *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=scaled(870),
    )
    assert out_json.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out_json.read_text())


def _config_key(c):
    return json.dumps(c, sort_keys=True)


@pytest.mark.aot_matrix
@pytest.mark.timeout(900)
def test_every_candidate_compiles_for_sm80_and_sm90(tmp_path, monkeypatch):
    from powersgd_triton.ops import configs
    from powersgd_triton.compat import env as _env

    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)  # the GPU heuristic, not the interpreter's

    proc, results = _run_aot(tmp_path, "--matrix-approximation-ranks", "4", "8", "16", "--ranks-for",
                            "orthogonalize=1,2,4,8,16,32")
    failed = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failed, proc.stdout[-4000:] + proc.stderr[-4000:]
    compiled = {(r["kernel"], _config_key(r["config"]), r["arch"]) for r in results}
    # every config the space offers at the compiled ranks (3 and 5 pad to 4 and 8), and every heuristic, was
    # compiled for both targets; the bf16 space holds the others (fp16's is the same, fp32's lacks project_t's
    # split tensor-core configs)
    for kernel in KERNELS:
        for rank in (3, 4, 5, 8, 16) if kernel != "orthogonalize" else (1, 2, 3, 4, 8, 16, 32):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                space = list(configs.config_space(kernel, rank, dtype))
                fake_layout = type("L", (), {"max_rank": rank})()
                space.append(configs.heuristic_config(kernel, fake_layout, dtype))
                for cfg in space:
                    for arch in (80, 90):
                        assert (kernel, _config_key(cfg), arch) in compiled, (kernel, rank, dtype, cfg, arch)
    # both paths of the matmul kernels at their own padded rank
    paths = {(r["kernel"], r["config"].get("USE_DOT"), r["R"]) for r in results}
    for kernel in ("project", "project_t", "reconstruct"):
        assert (kernel, False, 4) in paths and (kernel, True, 16) in paths
    print(proc.stdout)


@pytest.mark.aot_matrix
@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("POWERSGD_TRITON_SLOW_TESTS") != "1", reason="set POWERSGD_TRITON_SLOW_TESTS=1")
def test_orthogonalize_candidates_compile_at_rank16(tmp_path):
    """Orthogonalize's candidates at R=16 (its serial Gram-Schmidt steps are a loop, not unrolled: a few seconds
    each, like at R=4)."""
    from powersgd_triton.ops import configs

    proc, results = _run_aot(tmp_path, "--kernels", "orthogonalize", "--matrix-approximation-ranks", "16")
    assert proc.returncode == 0 and all(r["ok"] for r in results), proc.stdout[-4000:]
    assert len(results) == 2 * len(configs.config_space("orthogonalize", 16, torch.bfloat16))
