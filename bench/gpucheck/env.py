"""Sections ``env`` (versions, GPU, driver) and ``copy`` (the device's copy bandwidth, the kernels' yardstick)."""

import torch

from powersgd_triton import benchmarking as B

from .common import DEVICE, DRY, RESULTS, ROOT, generator, log, timed

# =============================================================================================== 1. env
def section_env():
    env = B.environment(DEVICE)
    try:
        import subprocess

        env["git"] = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %ad", "--date=short"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        pass
    RESULTS["sections"]["env"] = env
    for k, v in env.items():
        log(f"  {k}: {v}")


# =============================================================================================== 2. copy
def section_copy():
    n = (4 << 20) if DRY else (1 << 29)  # 2 GiB of fp32 on the GPU, far beyond L2
    src = torch.randn(n, device=DEVICE, generator=generator())
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    moved = 2 * n * 4
    gbs = moved / t["median_ms"] / 1e6
    ok = torch.equal(dst, src)
    RESULTS["sections"]["copy"] = dict(bytes=moved, **t, gb_s=gbs, copy_correct=bool(ok))
    log(f"  copy_: {moved / 1e9:.2f} GB (read + written) in {t['median_ms']:.3f} ms = {gbs:.0f} GB/s")
    del src, dst
