"""Heuristic, candidate configs and loop constexprs of ``orthogonalize`` (and its ``orthogonalize_gram`` launch).

Read by :mod:`.configs` (config space, heuristic), :mod:`.ortho_launch` (plans, launches) and :mod:`.aot_compile`.
No kernel is imported here.
"""

import functools
from typing import List, Optional

# Orthogonalize: a factor of at most SHORT_ROWS rows is done by one program (one launch for the bucket); the heuristic
# allows ORTHO_SHORT_BYTES of float32 factor per program (two passes over it by one SM, the second from L2: a few
# microseconds, about an extra launch), and splits taller factors (GPT-2's and BERT's embeddings) over rows.
ORTHO_SHORT_BYTES = 128 * 1024
# Rows per program of the apply pass of a split factor: >= 2 programs per SM of an H100/H200 (132 SMs) for BERT's
# 30522-row and GPT-2's 50257-row embeddings (318 and 524 programs).
ORTHO_SPLIT_ROWS = 96
# From rank 8 on, a factor taller than this many BLOCK tiles is split over rows (with Gram slots of as many tiles):
# at R 8-32 one program walking a factor's rows costs more than the extra Gram launch and the slot sums (model of
# an H200, perfmodel: ResNet-50 / GPT-2 / BERT fp32 steps, orthogonalization's share at R 8 23 % -> 16 %, R 16
# 42 % -> 24 %, R 32 52 % -> 22-27 %); at R <= 4 it changes nothing (the launches' fixed costs dominate).
ORTHO_WIDE_TILES = {8: 2, 16: 2, 32: 4}
# ... except a factor of at most ORTHO_WIDE_SHORT_ROWS rows, whose Gram every program of its apply pass computes
# itself (one launch, no Gram slots), one program per ORTHO_APPLY_ROWS rows (``APPLY_ROWS``): ResNet-50's P factors
# (<= 2048 rows) and GPT-2's and BERT's other than the embeddings then need no Gram launch. Model of an H200
# (perfmodel, fp32, ResNet-50 / GPT-2 / BERT): orthogonalization's share of the step at R 8 10.9-12.4 % -> 7.9-8.5 %,
# at R 16 9.6-12.1 % -> 8.6-9.1 % (1024 rows per program at R 16: the Gram of 4096 rows in one program, then a
# quarter of them written).
ORTHO_WIDE_SHORT_ROWS = {8: 4096, 16: 4096}
ORTHO_APPLY_ROWS = {8: 2048, 16: 1024}
# Rows per tile (BLOCK) and warps of the heuristic by padded rank (others: 1024 / R rows, 8 warps). Few programs run
# (one per short factor), so each takes a whole SM's worth of threads and as many rows per tile as 128 registers
# allow: a 4608-row Q (ResNet-50's 3x3 convolutions) is 5 tiles per pass at R 4 instead of 18. Seen on the sm_90
# compile (triton 3.9, ptxas -v) of both launches: no spills, 64-128 registers; ptxas is erratic here (R 2 at 2048
# rows spills 40 bytes, R 4 at 512 rows and 4 warps too), so each entry was checked. Model (perfmodel, H200):
# orthogonalization's share of the step at R 1-4 goes from 14-22 % to 9-13 %, at R 16 from 19-24 % to 14-19 %.
ORTHO_BLOCKS = {1: 2048, 2: 1024, 4: 1024, 8: 512, 16: 256}
ORTHO_WARPS = {1: 16, 2: 16, 4: 16, 8: 16, 16: 16}
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
# would make a 50257-row factor 785 slots, each summed by every program of its apply pass). Not tuned against the
# model.
OLDER_TRITON_ORTHO = {(3, 4): {4: (512, 8), 16: (32, 8, 256)}, (3, 6): {8: (256, 8), 16: (128, 8)}}
# Rows per tile of the Gram launch of split factors (orthogonalize_gram): at most this many, whatever BLOCK (its
# [BLOCK, R]ᵀ·[BLOCK, R] float64 dot at 1024-2048 rows spills 0.1-2.8 KiB at R <= 4; it has many programs anyway).
ORTHO_GRAM_BLOCK = 256
# Largest [BLOCK, R] tile of an orthogonalize candidate, in float64 elements per thread (held in registers): 8, as
# in every heuristic (twice that spills 0.2-15 KiB on the sm_90 compile at R 4 and R 16).
ORTHO_MAX_TILE_PER_THREAD = 8


def _ortho_heuristic(R: int) -> dict:
    """Orthogonalize default at padded rank R, from a model of an H100/H200 (132 SMs, ~4 TB/s, 64K registers/SM).

    * ``BLOCK`` rows per tile and warps: :data:`ORTHO_BLOCKS` and :data:`ORTHO_WARPS` (2048 rows at R 1, 1024 at
      R 2-4, 512 at R 8, 256 at R 16, 16 warps; R 32: 32 rows, 8 warps), held in float64 in registers. Chosen from
      the sm_90 compile (ptxas -v, triton 3.9): no spills at any R <= 32, at most 128 registers per thread up to
      R 16 (triton <= 3.6: half the rows at 8 warps at R 8 and 16; triton 3.4 also at R 4, and 32 rows at R 16:
      :data:`OLDER_TRITON_ORTHO`; at R 32 triton 3.4 spills at every tile tried); the Gram launch
      reads at most :data:`ORTHO_GRAM_BLOCK` rows per tile;
    * ``SHORT_ROWS``: up to R 4, ``ORTHO_SHORT_BYTES`` of factor per program, at most 32 tiles (8192 rows at R 4,
      16384 at R 2, 32768 at R 1: ResNet-50's, BERT's and GPT-2's layers other than the embeddings are one launch);
      at R 8 and 16 :data:`ORTHO_WIDE_SHORT_ROWS` (4096), their apply pass split into ``APPLY_ROWS``
      (:data:`ORTHO_APPLY_ROWS`: 2048 at R 8, 1024 at R 16) rows per program, each computing the whole Gram; at
      R 32 ``ORTHO_WIDE_TILES[R]`` tiles (128 rows): taller factors are split;
    * ``GRAM_ROWS``: rows per float64 Gram slot, ``max(BLOCK, 512)`` up to R 4, ``ORTHO_WIDE_TILES[R]`` tiles from
      R 8 on (1024 rows at R 8, 512 at R 16, 128 at R 32). Every
      program of the apply pass sums all slots of its matrix, ``slots·R²·8`` bytes from L2 (GPT-2's 50257 rows: 50
      slots, 6 KiB at R 4; 99 slots, 200 KiB at R 16), and the Gram launch has one program per slot (4-64 KiB of
      factor each);
    * ``SPLIT_ROWS``: ``ORTHO_SPLIT_ROWS`` up to R 8 (>= 2 programs per SM for the embeddings), twice that
      above (the slots every program sums grow as R²: half the programs, half the L2 traffic); 3 stages (the row
      loops are software-pipelined, several tiles in flight per SM).
    """
    block, warps = ORTHO_BLOCKS.get(R, max(16, 1024 // R)), ORTHO_WARPS.get(R, 8)
    older = _older_triton_ortho(R)
    if older is not None:  # this Triton spills the entry (OLDER_TRITON_ORTHO)
        block, warps = older[:2]
    extra = {}
    if R <= 4:
        short = max(block, min(ORTHO_SHORT_BYTES // (4 * R), 32 * block))
        gram = max(block, 512)
    else:
        short = gram = ORTHO_WIDE_TILES.get(R, 4) * block
        if older is not None and len(older) > 2:
            gram = older[2]
        if R in ORTHO_WIDE_SHORT_ROWS:
            short, extra = ORTHO_WIDE_SHORT_ROWS[R], dict(APPLY_ROWS=ORTHO_APPLY_ROWS[R])
    split = ORTHO_SPLIT_ROWS if R <= 8 else 2 * ORTHO_SPLIT_ROWS
    return dict(BLOCK=block, SHORT_ROWS=short, GRAM_ROWS=gram, SPLIT_ROWS=split, num_warps=warps, num_stages=3,
                **extra)


@functools.lru_cache(maxsize=None)
def _older_triton_ortho(R: int) -> Optional[tuple]:
    """(BLOCK, num_warps[, GRAM_ROWS]) of :data:`OLDER_TRITON_ORTHO` for the installed Triton at padded rank R, or
    None."""
    from powersgd_triton.compat import versions as _compat

    v = _compat.triton_version()
    if v is None:
        return None
    for newest, entries in sorted(OLDER_TRITON_ORTHO.items()):
        if tuple(v[:2]) <= newest and R in entries:
            return entries[R]
    return None


def _ortho_configs(R: int) -> List[dict]:
    """Orthogonalize candidates at padded rank R: the heuristic of every rank 1..32, at its own warps and at 8 (or 4
    where it has 8), whose float64 tile fits (``BLOCK * R <= ORTHO_MAX_TILE_PER_THREAD * 32 * num_warps``); the
    rank's own heuristic first. Rank 1's candidates include every other rank's."""
    own = _ortho_heuristic(R)
    out = [own]
    for r in (1, 2, 4, 8, 16, 32):
        h = _ortho_heuristic(r)
        for c in (h, dict(h, num_warps=4 if h["num_warps"] == 8 else 8)):
            if c["BLOCK"] * R <= ORTHO_MAX_TILE_PER_THREAD * 32 * c["num_warps"] and c not in out:
                out.append(c)
    return out


def _check_ortho_config(cfg: dict) -> None:
    """Raise ``ValueError`` unless BLOCK is a power of two >= 16, SHORT_ROWS and GRAM_ROWS multiples of it and
    SPLIT_ROWS (and APPLY_ROWS, when given) a positive multiple of 16 (a split program writes ceil(SPLIT_ROWS /
    BLOCK) tiles, masked)."""
    block = cfg.get("BLOCK")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"orthogonalize config: BLOCK must be a power of two >= 16, got {block!r}")
    for key in ("SHORT_ROWS", "GRAM_ROWS"):
        v = cfg.get(key)
        if not isinstance(v, int) or v < block or v % block:
            raise ValueError(f"orthogonalize config: {key} must be a multiple of BLOCK ({block}), got {v!r}")
    split = cfg.get("SPLIT_ROWS")
    if not isinstance(split, int) or split < 16 or split % 16:
        raise ValueError(f"orthogonalize config: SPLIT_ROWS must be a positive multiple of 16, got {split!r}")
    apply = cfg.get("APPLY_ROWS", cfg["SHORT_ROWS"])
    if not isinstance(apply, int) or apply < 16 or apply % 16:
        raise ValueError(f"orthogonalize config: APPLY_ROWS must be a positive multiple of 16, got {apply!r}")


def _ortho_slot_block(R: int) -> int:
    """Gram slots summed per step by a program of a split factor: 16 KiB of float64 per load (2 to 64 slots)."""
    return max(2, min(64, 2048 // (R * R)))


def _ortho_constexprs(cfg: dict, R: int) -> dict:
    """The orthogonalize kernels' loop constexprs, functions of the config and the padded rank R: ``GRAM_BLOCK``
    (rows per tile of the Gram launch, ``min(BLOCK, ORTHO_GRAM_BLOCK)``), ``GROUP_TILES`` (its tiles per Gram slot,
    ``GRAM_ROWS // GRAM_BLOCK``), ``CHUNK_TILES`` (tiles per unconditional inner loop), ``SHORT_CHUNKS``,
    ``APPLY_CHUNKS`` and ``SLOT_BLOCK``."""
    _check_ortho_config(cfg)
    block = cfg["BLOCK"]
    gram_block = min(block, ORTHO_GRAM_BLOCK)
    chunk_tiles = min(4, cfg["SHORT_ROWS"] // block)
    chunk = chunk_tiles * block
    return dict(
        BLOCK=block,
        GRAM_BLOCK=gram_block,
        GROUP_TILES=cfg["GRAM_ROWS"] // gram_block,
        CHUNK_TILES=chunk_tiles,
        SHORT_CHUNKS=-(-cfg["SHORT_ROWS"] // chunk),
        APPLY_CHUNKS=-(-max(cfg["SHORT_ROWS"], cfg["SPLIT_ROWS"]) // chunk),
        SLOT_BLOCK=_ortho_slot_block(R),
    )
