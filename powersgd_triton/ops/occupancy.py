"""Occupancy arithmetic of NVIDIA GPUs: how many blocks of a kernel fit on one SM (no GPU, no Triton needed).

Used by the launch plans (:func:`powersgd_triton.ops.projection_t.project_t_programs_per_sm`) and by the
autotuner's compile tools (:func:`tools.aot.resource_usage`, which re-exports these names).
"""

from typing import Dict


# Per-SM limits of the occupancy calculation (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"; the arithmetic of cuda_occupancy.h): 64K 32-bit registers in 4 sub-partitions, allocated per warp in
# units of 256, at most 255 per thread; 2048 threads (64 warps) and 32 blocks per SM; shared memory per SM 164 KiB
# (A100) / 228 KiB (H100, H200), allocated in 128-byte units, plus 1 KiB the system reserves per block.
SM_LIMITS = {
    80: dict(regs=65536, sub_partitions=4, reg_unit=256, max_regs_per_thread=255, warps=64, blocks=32,
             shared=164 * 1024, shared_unit=128, shared_reserved=1024),
    90: dict(regs=65536, sub_partitions=4, reg_unit=256, max_regs_per_thread=255, warps=64, blocks=32,
             shared=228 * 1024, shared_unit=128, shared_reserved=1024),
}


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int, arch: int) -> Dict[str, int]:
    """How many blocks of a kernel fit on one SM of ``sm_<arch>`` (80 or 90): the minimum of four limits.

    ``registers`` per thread, ``num_warps`` per block, ``shared_bytes`` of shared memory per block (Triton's
    dynamic shared memory plus any static). Returns ``blocks_per_sm`` and the limits ``by_registers``
    (each of the 4 sub-partitions holds ``16384 // round_up(32 * registers, 256)`` warps), ``by_shared``,
    ``by_warps`` (64 per SM) and ``by_blocks`` (32 per SM). Raises ``ValueError`` for another arch.
    """
    if arch not in SM_LIMITS:
        raise ValueError(f"no occupancy limits for sm_{arch}; known: {sorted(SM_LIMITS)}")
    lim = SM_LIMITS[arch]
    if registers > lim["max_regs_per_thread"]:
        by_regs = 0
    else:
        regs_per_warp = _round_up(max(registers, 1) * 32, lim["reg_unit"])
        warps_per_part = (lim["regs"] // lim["sub_partitions"]) // regs_per_warp
        by_regs = warps_per_part * lim["sub_partitions"] // num_warps
    smem = _round_up(shared_bytes + lim["shared_reserved"], lim["shared_unit"])
    by_shared = lim["shared"] // smem
    by_warps = lim["warps"] // num_warps
    limits = dict(by_registers=by_regs, by_shared=by_shared, by_warps=by_warps, by_blocks=lim["blocks"])
    return dict(blocks_per_sm=min(limits.values()), **limits)
