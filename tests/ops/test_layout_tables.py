"""The kernel tables read by column name (powersgd_triton.ops.tables' ``*_COLUMNS``) describe the bucket they were built
for: the layout table holds each matrix's MatrixSpec, and every tile table covers each element it is for exactly once.

Host-side only (no kernel runs): the kernels read the same columns through the constexprs of
``powersgd_triton.ops.common``, whose values are checked against these names here too.
"""

import numpy as np
import pytest
import torch

from powersgd_triton.ops import tables as L
from powersgd_triton.layout import BucketLayout


def _randint(rng, lo, hi):
    return int(torch.randint(lo, hi, (), generator=rng))


def _random_layout(rng, batched):
    shapes = [(_randint(rng, 1, 40), _randint(rng, 1, 50)) for _ in range(_randint(rng, 2, 6))]
    shapes.append((_randint(rng, 1, 20),))  # a bias: sent uncompressed
    total = sum(int(np.prod(s)) for s in shapes)
    if batched:
        return BucketLayout.batched(total, _randint(rng, 1, 5), "cpu")
    buf = torch.zeros(total)
    grads, off = [], 0
    for s in shapes:
        n = int(np.prod(s))
        grads.append(buf[off : off + n].view(s))
        off += n
    return BucketLayout.from_gradients(buf, grads, _randint(rng, 1, 5), 1.0)


def test_kernel_constexprs_are_the_layout_columns():
    from powersgd_triton.ops import common

    names = [n for n in dir(L) if n.isupper() and isinstance(getattr(L, n), int) and hasattr(common, n)]
    assert {"TABLE_WIDTH", "RANK", "RECON_COL_END", "REDUCE_SPLITS", "PROJECT_T_WS_OFF", "AVERAGE_COUNT"} <= set(names)
    for n in names:
        assert getattr(common, n).value == getattr(L, n), n
    assert L.TABLE_WIDTH == len(L.TABLE_COLUMNS) == 8
    # the two int32 [T, 4] tables are different tables
    assert L.RECON_TILE_COLUMNS != L.REDUCE_TILE_COLUMNS


@pytest.mark.parametrize("batched", [False, True])
def test_tables_by_column_name_cover_the_bucket(batched, rng):
    for _ in range(5):
        lay = _random_layout(rng, batched)
        mats = lay.matrices
        table = lay.table.numpy()
        assert table.shape == (len(mats), L.TABLE_WIDTH)
        for row, s in zip(table, mats):
            assert (row[L.OFF], row[L.ROWS], row[L.COLS], row[L.NUMEL], row[L.RANK]) == (
                s.offset, s.n, s.m, s.numel, s.rank)
            assert (row[L.P_OFF], row[L.Q_OFF], row[L.E_OFF]) == (s.p_offset, s.q_offset, s.e_offset)

        block = (4, 8, 16)[_randint(rng, 0, 3)]
        split = (0, 4, 8)[_randint(rng, 0, 3)]
        # project: every row of every matrix in one tile
        t = L.tiles(lay, "rows", block).numpy()
        assert t.shape[1] == L.TILE_WIDTH
        for i, s in enumerate(mats):
            firsts = sorted(t[t[:, L.TILE_MAT] == i, L.TILE_FIRST])
            assert firsts == list(range(0, s.n, block))

        # reconstruct: every element of every matrix in exactly one (row block, column range)
        t = L.reconstruct_tiles(lay, block, split).numpy()
        assert t.shape[1] == L.RECON_TILE_WIDTH
        for i, s in enumerate(mats):
            hits = np.zeros((s.n, s.m), dtype=np.int64)
            for row in t[t[:, L.RECON_MAT] == i]:
                r0, c0, c1 = row[L.RECON_ROW0], row[L.RECON_COL0], row[L.RECON_COL_END]
                assert c0 < c1 <= s.m
                hits[r0 : r0 + block, c0:c1] += 1
            assert (hits == 1).all()

        # project_t: every element in exactly one (column block, row range); the reduce tiles (reduce_block
        # columns each, at most the column block) cover every column of a split matrix once, with its splits
        reduce_block = (block, max(1, block // 2), 3)[_randint(rng, 0, 3)]
        t, red, ws = L.project_t_tiles(lay, block, split, reduce_block)
        t = t.numpy()
        assert t.shape[1] == L.PROJECT_T_TILE_WIDTH
        red = np.zeros((0, L.REDUCE_TILE_WIDTH), dtype=np.int32) if red is None else red.numpy()
        assert red.shape[1] == L.REDUCE_TILE_WIDTH
        ws_want = 0
        for i, s in enumerate(mats):
            hits = np.zeros((s.n, s.m), dtype=np.int64)
            mine = t[t[:, L.PROJECT_T_MAT] == i]
            for row in mine:
                r0, r1, c0 = row[L.PROJECT_T_ROW0], row[L.PROJECT_T_ROW_END], row[L.PROJECT_T_COL0]
                hits[r0:r1, c0 : c0 + block] += 1
            assert (hits == 1).all()
            reduced = np.zeros(s.m, dtype=np.int64)
            for row in red[red[:, L.REDUCE_MAT] == i]:
                c0 = row[L.REDUCE_COL0]
                reduced[c0 : c0 + reduce_block] += 1
                tile0 = c0 - c0 % block  # the project_t column tile holding these columns
                parts = mine[mine[:, L.PROJECT_T_COL0] == tile0]
                assert len(parts) == row[L.REDUCE_SPLITS] > 1
                assert parts[0, L.PROJECT_T_WS_OFF] == row[L.REDUCE_WS_OFF]
                assert list(np.diff(parts[:, L.PROJECT_T_WS_OFF])) == [s.m * s.rank] * (len(parts) - 1)
            splits = -(-s.n // split) if split and s.n > split else 1
            assert len(red[red[:, L.REDUCE_MAT] == i]) == (-(-s.m // reduce_block) if splits > 1 else 0)
            assert (reduced == (1 if splits > 1 else 0)).all()
            if splits == 1:
                assert (mine[:, L.PROJECT_T_WS_OFF] == -1).all()
            else:
                ws_want += splits * s.m * s.rank
        assert ws == ws_want

        # average: each factor element and each uncompressed element in exactly one chunk
        for which in ("p", "q"):
            t, first = L.average_tiles(lay, which, True, block)
            t, first = t.numpy(), first.numpy()
            assert t.shape[1] == L.AVERAGE_TILE_WIDTH
            numel = lay.p_numel if which == "p" else lay.q_numel
            hits = np.zeros(numel, dtype=np.int64)
            for k, row in enumerate(t[: first[-1]]):
                mat = row[L.AVERAGE_MAT]
                assert first[mat] <= k < first[mat + 1] and row[L.AVERAGE_SRC] == row[L.AVERAGE_DST]
                hits[row[L.AVERAGE_SRC] : row[L.AVERAGE_SRC] + row[L.AVERAGE_COUNT]] += 1
            assert (hits == 1).all()
            unc = t[first[-1] :]
            assert (unc[:, L.AVERAGE_MAT] == -1).all()
            assert unc[:, L.AVERAGE_COUNT].sum() == lay.uncompressed_numel


def test_table_row_needs_every_column_once():
    assert L.table_row(3, {2: 7, 0: 5, 1: 6}) == [5, 6, 7]
    with pytest.raises(ValueError, match="each once"):
        L.table_row(3, {0: 1, 1: 2})
    with pytest.raises(ValueError, match="each once"):
        L.table_row(2, {0: 1, 1: 2, 2: 3})


def test_factor_columns_name_the_factor_and_reject_others(rng):
    from powersgd_triton.ops import launch, orthogonalization, segments

    assert launch.factor_columns("p") == dict(ROWS_COL=L.ROWS, OFF_COL=L.P_OFF)
    assert launch.factor_columns("q") == dict(ROWS_COL=L.COLS, OFF_COL=L.Q_OFF)
    lay = _random_layout(rng, False)
    new = torch.randn(lay.q_numel, generator=rng) + 1.0
    kept = torch.randn(lay.q_numel, generator=rng)
    before = kept.clone()
    with pytest.raises(ValueError, match="'p' or 'q'"):
        segments.commit_factor(new, kept, lay, "x", torch.ones(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'p' or 'q'"):
        orthogonalization.orthogonalize(new, lay, "Q", 0.0, kept)
    assert torch.equal(kept, before)


@pytest.mark.parametrize("which", ["p", "q"])
def test_orthogonalize_task_tables_by_column_name_cover_each_factor(which, rng):
    """orthogonalize's task tables (``tables.ORTHO_GRAM_TASK_COLUMNS``, ``ORTHO_TASK_COLUMNS``): a short factor is one
    task over all its rows without Gram slots; a tall one has Gram tasks over consecutive GRAM_ROWS row blocks, each in
    its own slot (the first naming the matrix's head slot), and finish tasks that cover its rows once and read all
    those slots; completion vectors are the rank's next power of two."""
    from powersgd_triton.ops import orthogonalization

    cfg = dict(BLOCK=16, SHORT_ROWS=16, GRAM_ROWS=32, SPLIT_ROWS=16, num_warps=4, num_stages=1)
    for _ in range(4):
        lay = _random_layout(rng, batched=False)
        plan = orthogonalization._ortho_plan(lay, which, cfg)
        gram, tasks = (t.numpy() if t is not None else np.zeros((0, L.ORTHO_GRAM_TASK_WIDTH), np.int64)
                       for t in plan.device_tables("cpu"))
        assert gram.shape[1] == L.ORTHO_GRAM_TASK_WIDTH and tasks.shape[1] == L.ORTHO_TASK_WIDTH
        used_slots = set()
        for i, s in enumerate(lay.matrices):
            rows = s.n if which == "p" else s.m
            rm = 1 << (s.rank - 1).bit_length()
            mine = tasks[tasks[:, L.ORTHO_MAT] == i]
            covered = sorted((t[L.ORTHO_ROW0], t[L.ORTHO_ROW_END]) for t in mine)
            assert covered[0][0] == 0 and covered[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
            assert (mine[:, L.ORTHO_RM] == rm).all()
            g = gram[gram[:, L.GRAM_MAT] == i]
            if rows <= cfg["SHORT_ROWS"]:
                assert len(mine) == 1 and len(g) == 0
                assert mine[0, L.ORTHO_SLOTS] == 0 and mine[0, L.ORTHO_HEAD] == -1
                continue
            assert list(g[:, L.GRAM_ROW0]) == list(range(0, rows, cfg["GRAM_ROWS"]))
            slots = list(g[:, L.GRAM_SLOT])
            assert slots == list(range(slots[0], slots[0] + len(g))) and not used_slots & set(slots)
            used_slots |= set(slots)
            head = g[0, L.GRAM_HEAD]
            assert head >= 0 and (g[1:, L.GRAM_HEAD] == -1).all() and head not in used_slots
            used_slots.add(head)
            assert (g[:, L.GRAM_RM] == rm).all()
            assert (mine[:, L.ORTHO_SLOT0] == slots[0]).all() and (mine[:, L.ORTHO_SLOTS] == len(g)).all()
            assert (mine[:, L.ORTHO_HEAD] == head).all()


def test_a_layout_pickles_without_its_derived_plans():
    """A layout's memo holds launch plans (compiled-kernel handles, which do not pickle: the test of the factor bytes
    in tests/hooks/test_comm_dtype_ddp.py sends layouts between processes); pickling drops them and they are rebuilt."""
    import pickle

    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    layout = _random_layout(rng, batched=False)
    tiles = L.tiles(layout, "rows", 4).clone()
    layout.memo(("a plan",), lambda: (lambda: None))  # like a launch plan: not picklable
    back = pickle.loads(pickle.dumps(layout))
    assert back.signature == layout.signature and back.num_matrices == layout.num_matrices
    assert back.memo(("a plan",), lambda: 7) == 7  # rebuilt, not carried
    assert torch.equal(L.tiles(back, "rows", 4), tiles)
    assert ("a plan",) in layout._tiles  # the original keeps its plans
