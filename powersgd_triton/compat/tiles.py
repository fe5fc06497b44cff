"""Per-Triton-version tile overrides: the heuristic tiles an older Triton's register allocation spills, and what
that Triton takes instead.

The tile tables of :mod:`powersgd_triton.ops.configs` are chosen on the newest tested Triton (3.9); an older one may
spill a table's tile (ptxas -v on the sm_90 compile, ``tests/test_compile_table.py``). The configs ask this module
for the override of the installed Triton (:func:`broadcast_override`, :func:`dot_override`,
:func:`ortho_override`); adding a Triton version touches only this folder, ``.ci/compat`` and the docs. Each table
is keyed by the newest triton ``(major, minor)`` an entry applies to; the first (oldest) entry holding a key wins.
"""

import functools
from typing import Optional

from powersgd_triton.compat import versions as _versions

# Tiles for an older Triton whose register allocation spills a table's tile: {the newest triton (major, minor) the
# entry applies to: {(kernel, padded rank, element size): tile}} (broadcast_tile). Seen on the sm_90 compile under
# triton 3.6 (ptxas -v, every variant): reconstruct's R 8 tile 16 x 32 PREFETCH 2 spills 56 bytes in fp32 and 104
# in bf16 (PREFETCH 1: 24 / 32); the nearest tile that does not spill keeps BLOCK_K, PREFETCH and maxnreg and takes
# half the rows (8 x 32 PREFETCH 2 at 128 registers: no spills in fp32, bf16); likewise R 2 bf16, whose 16 x 32
# PREFETCH 2 spills 8 bytes in the padding-error commit variant (8 x 32: 72-122 registers, none). project_t's broadcast tiles (split +
# HAS_Q2, split, plain) spill under triton 3.6 at six of its eight entries (bytes: R 1 fp32 224-236, R 1 bf16 176,
# R 2 bf16 36, R 4 fp32 12, R 4 bf16 176-484, R 8 fp32 28-64); the nearest that does not spill keeps the tile and
# PREFETCH and raises maxnreg to the next notch that holds it (R 1 fp32 and bf16: 72 -> 96, 80 still spills; R 2
# bf16: 72 -> 80; R 4 fp32: 96 -> 112), or where the cap is already 128 takes half the rows per step (R 4 bf16:
# 512 x 2 PREFETCH 1; R 8 fp32: 256 x 4 PREFETCH 0). triton 3.4 takes those and also spills project_t's R 2 fp32
# tile (512 x 2 PREFETCH 2 at 72: 24 bytes), so 80 there, and reconstruct's R 4 tile (8 x 64 PREFETCH 2 at 128:
# 40-168 bytes in fp32, 152-160 in bf16, in the commit variants), so half the rows (4 x 64: none). The whole compile
# table (tests/test_compile_table.py: every variant x fp32/bf16/fp16, triton 3.6) found two more under 3.6, in 2-byte
# gradients at R 4: project_t's 512 x 2 PREFETCH 1 spills 16 bytes in fp16's wire variant (512 x 1: 111-128
# registers, none in the wire, second-Q and plain variants, bf16 and fp16), reconstruct's 8 x 64 PREFETCH 2 8-16
# bytes in fp16's padding-error commit variants (4 x 64, triton 3.4's tile: 120-123 registers, none). Under triton
# 3.8 (the same table): project_t's R 1 bf16 tile spills 16 bytes (maxnreg 72 -> 96, as 3.6: none), reconstruct's
# R 1 fp32 and R 2 fp16 16 x 32 tiles 16-24 bytes in the padding-error commit variants (half the rows, 8 x 32: none
# in all 12 variants, also under 3.6 for R 1 fp32), project_t's batched tile at R 8 in bf16 88 bytes in the
# padding-error, loss-scale, wire variant (half the rows per step, 512 x 2 PREFETCH 0: none in the 4 batched
# variants, under 3.6 too); "project_t_batched" keys project_t_batched_tile. The first entry (the oldest) holding
# a key wins. Under triton 3.6 project's aligned R 1 and R 2 tiles of 2-byte gradients (``"project_aligned"``, the
# aligned layout's ALIGNED_PROJECT_TILES; 8 x 128 PREFETCH 1, no cap) spill in the variant without error feedback
# that packs the uncompressed gradients (PACK; R 1: 16 bytes in bf16, 6 in fp16, ptxas picking 40 registers and
# spilling a pointer of the loop; R 2: 18 bytes in fp16 at 48); with maxnreg 96 every aligned variant takes 56-72
# (R 1) and 63-90 (R 2) registers and spills nothing. Not tuned against the model.
OLDER_TRITON_TILES = {
    (3, 4): {("project_t", 2, 4): (512, 2, 2, 80), ("reconstruct", 4, 4): (4, 64, 2, 128)},
    (3, 6): {("reconstruct", 8, 4): (8, 32, 2, 128), ("reconstruct", 8, 2): (8, 32, 2, 128),
             ("reconstruct", 2, 2): (8, 32, 2, 128), ("reconstruct", 4, 2): (4, 64, 2, 128),
             ("project_t", 1, 4): (512, 4, 1, 96), ("project_t", 1, 2): (256, 8, 1, 96),
             ("project_t", 2, 2): (512, 2, 2, 80), ("project_t", 4, 4): (512, 2, 2, 112),
             ("project_t", 4, 2): (512, 1, 1, 128), ("project_t", 8, 4): (256, 4, 0, 128),
             ("project_aligned", 1, 2): (8, 128, 1, 96), ("project_aligned", 2, 2): (8, 128, 1, 96)},
    (3, 8): {("project_t", 1, 2): (256, 8, 1, 96), ("reconstruct", 1, 4): (8, 32, 2, 128),
             ("reconstruct", 2, 2): (8, 32, 2, 128), ("project_t_batched", 8, 2): (512, 2, 0, 128)},
}
# The tl.dot heuristics (R >= 16) changed for an older Triton: {newest triton (major, minor): {(kernel, padded rank,
# element size): the keys replaced}}, first (oldest) entry wins (dot_config). Seen under triton 3.6 (sm_90, ptxas -v,
# the whole compile table): reconstruct at R 32 in fp32 (16 x 32, 2 stages) spills 16 bytes in the padding-error
# commit variant with the loss scale (168 registers); half the columns per step (16 x 16, 2 stages) spill nothing
# (128-132 registers), one stage less neither (166-176). Under triton 3.8 (the table with project's PACK variants,
# CI of 2026-12-06): project at R 16 on 2-byte gradients (16 x 64, 3 stages) spills 8 bytes at 168 registers in the
# four variants that pack the uncompressed gradients (bf16 and fp16; the others none); half the columns per step
# (16 x 32, 3 stages) spill nothing (136 registers in the PACK variants), as one stage less would not (135-174).
# Not tuned against the model.
OLDER_TRITON_DOT = {(3, 6): {("reconstruct", 32, 4): dict(BLOCK_K=16)},
                    (3, 8): {("project", 16, 2): dict(BLOCK_K=32)}}
# (BLOCK, num_warps) by padded rank for an older Triton whose register allocation spills the entries above: {the
# newest triton (major, minor) the entry applies to: {R: (BLOCK, num_warps)}}; the first entry (the oldest) holding
# R wins. Seen on the sm_90 compile under triton 3.6 (ptxas -v, tests/test_compile_table.py): at 16 warps (at most
# 128 registers per thread) orthogonalize spills 976 bytes at R 8 (512 rows) and 244 at R 16 (256 rows), its Gram
# launch 100 at R 8; half the rows at 16 warps still spill (364, 188), so do 1-2 stages (976 at R 8, 60-116 at
# R 16). Half the rows at 8 warps, the same 8 float64 of the tile per thread with up to 255 registers, spill nothing
# (194 and 182 registers; Gram 99 and 106). Under triton 3.4 (no float64 tl.dot: the products are broadcast and
# summed) R 4's 1024 rows at 16 warps spill 296 bytes (512 rows: 64): 512 rows at 8 warps spill nothing (164
# registers); and the R 16 entry above still spills 248 bytes (255 registers;
# 64 rows: 152 at 8 warps, 16 at 4; 128 rows at 16 warps 1408): 32 rows at 8 warps spill nothing (173 registers,
# Gram 75), with an optional third element, GRAM_ROWS, kept at 256 rows per Gram slot (8 tiles: two tiles' worth
# would make a 50257-row factor 785 slots, each summed by every program of its apply pass). Compiled as the JIT
# compiles a GPU launch (16-byte aligned pointers marked divisible by 16, issue 39), triton 3.6's R 4 entry (1024
# rows, 16 warps, 3 stages) drops to 64 registers and spills 1,840 bytes (without the attributes: 128 registers,
# none); 512 rows at 8 warps (GRAM_ROWS 512, as under 3.4) spill nothing. Under triton 3.4, so compiled, R 8's
# 256 rows at 8 warps (3.6's entry) spill 72 bytes (255 registers): 128 rows at 8 warps, GRAM_ROWS kept at 512, none
# (171 registers, Gram 80; 16 warps at 256 rows: 612 bytes); R 32's 32 rows at 8 warps spill 2,576 bytes (was
# 1,868 without the attributes): 16 rows at 8 warps 344 (16 at 4 warps 2,028, 16 at 16 1,636, 32 at 4 9,364, 32 at
# 16 3,156, 64 at 8 3,856), GRAM_ROWS 128 (tests/test_compile_table.py allows 3.4 this one). Not tuned against the
# model.
OLDER_TRITON_ORTHO = {(3, 4): {4: (512, 8), 8: (128, 8, 512), 16: (32, 8, 256), 32: (16, 8, 128)},
                      (3, 6): {4: (512, 8), 8: (256, 8), 16: (128, 8)}}


@functools.lru_cache(maxsize=None)
def _triton_minor() -> Optional[tuple]:
    v = _versions.triton_version()
    return None if v is None else tuple(v[:2])


def broadcast_override(kernel: str, r: int, es: int) -> Optional[tuple]:
    """The broadcast-path tile ``(tile, BLOCK_K, PREFETCH, maxnreg)`` of ``kernel`` (``"project"``, ``"project_t"``,
    ``"reconstruct"``, ``"project_t_batched"``, ``"project_aligned"``) at padded rank ``r`` and gradient element size ``es`` for the
    installed Triton: :data:`OLDER_TRITON_TILES`' entry for a triton at or below the entry's version, else None (the
    table's tile)."""
    v = _triton_minor()
    if v is not None:
        for newest, tiles in sorted(OLDER_TRITON_TILES.items()):
            if v <= newest and (kernel, r, es) in tiles:
                return tiles[(kernel, r, es)]
    return None


def dot_override(kernel: str, r: int, es: int) -> Optional[dict]:
    """The keys of ``kernel``'s tl.dot heuristic at padded rank ``r`` and gradient element size ``es`` that the
    installed Triton replaces (:data:`OLDER_TRITON_DOT`, for a triton at or below an entry's version), else None."""
    v = _triton_minor()
    if v is not None:
        for newest, entries in sorted(OLDER_TRITON_DOT.items()):
            if v <= newest and (kernel, r, es) in entries:
                return entries[(kernel, r, es)]
    return None


@functools.lru_cache(maxsize=None)
def ortho_override(R: int) -> Optional[tuple]:
    """(BLOCK, num_warps[, GRAM_ROWS]) of :data:`OLDER_TRITON_ORTHO` for the installed Triton at padded rank R, or
    None."""
    v = _versions.triton_version()
    if v is None:
        return None
    for newest, entries in sorted(OLDER_TRITON_ORTHO.items()):
        if tuple(v[:2]) <= newest and R in entries:
            return entries[R]
    return None
