"""Launchers and launch plans of ``orthogonalize`` (one launch, or two when a factor is split over rows).

:class:`_OrthoPlan` builds the task tables of one call once per layout and config (kept weakly with the layout,
with the float64 Gram workspace); :func:`orthogonalize` launches from them, :func:`orthogonalize_plan` describes
the launches for the performance model. Configs: :mod:`.ortho_configs`; the kernels:
:mod:`powersgd_triton.ops.orthogonalization`.
"""

import weakref
from typing import List, Optional

import torch

from powersgd_triton.compat.versions import DirectLaunch
from powersgd_triton.layout import BucketLayout, padded_rank, table_row
from powersgd_triton.layout import GRAM_HEAD, GRAM_MAT, GRAM_N, GRAM_OFF, GRAM_R, GRAM_RM, GRAM_ROW0, GRAM_SLOT, ORTHO_GRAM_TASK_WIDTH
from powersgd_triton.layout import ORTHO_HEAD, ORTHO_MAT, ORTHO_N, ORTHO_OFF, ORTHO_R, ORTHO_RM, ORTHO_ROW0, ORTHO_ROW_END
from powersgd_triton.layout import ORTHO_SLOT0, ORTHO_SLOTS
from powersgd_triton.layout import ORTHO_TASK_WIDTH
from powersgd_triton.ops.configs import _resolve
from powersgd_triton.ops.launch_common import _launch_options, factor_columns
from powersgd_triton.ops.ortho_configs import _ortho_constexprs
from powersgd_triton.ops.orthogonalization import _ortho_gram_kernel, _orthogonalize_kernel

# Per layout (weakly held): {(which, R, BLOCK, SHORT_ROWS, GRAM_ROWS, SPLIT_ROWS, APPLY_ROWS): _OrthoPlan}
_ORTHO_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _OrthoPlan:
    """Host-side launch plan of one orthogonalize call (see :func:`orthogonalize_plan`); device tables made lazily."""

    def __init__(self, layout: BucketLayout, which: str, cfg: dict):
        self.R = padded_rank(layout.max_rank)
        self.consts = _ortho_constexprs(cfg, self.R)
        short, gram_rows, split = cfg["SHORT_ROWS"], cfg["GRAM_ROWS"], cfg["SPLIT_ROWS"]
        apply = cfg.get("APPLY_ROWS", short)
        chunk = self.consts["CHUNK_TILES"] * cfg["BLOCK"]
        self.gram_tasks: List[List[int]] = []  # rows of layout.ORTHO_GRAM_TASK_COLUMNS
        self.tasks: List[List[int]] = []  # rows of layout.ORTHO_TASK_COLUMNS
        self.tiles: List[int] = []  # per finish task: tiles of BLOCK rows read and written (chunks rounded up)
        self.slot_steps: List[int] = []  # per finish task: steps of the slot sum
        slot = 0
        self.split_matrices = 0
        self.factor_elems = 0  # valid elements of the factors
        self.split_elems = 0
        self.regram_elems = 0  # factor elements read again by the extra programs of short factors (APPLY_ROWS)
        for i, s in enumerate(layout.matrices):
            rows = s.n if which == "p" else s.m
            rm = padded_rank(s.rank)  # completion vectors of this factor (the torch backend's too)
            factor = {ORTHO_N: rows, ORTHO_R: s.rank, ORTHO_OFF: s.p_offset if which == "p" else s.q_offset}
            self.factor_elems += rows * s.rank
            if rows <= short:
                # one program per APPLY_ROWS rows, each with the factor's whole Gram (the same tiles in the same
                # order: the same bits in every program, and as one program would write them)
                gram_tiles = -(-rows // chunk) * self.consts["CHUNK_TILES"]
                for c in range(0, rows, apply):
                    end = min(c + apply, rows)
                    self.tasks.append(table_row(ORTHO_TASK_WIDTH, {ORTHO_MAT: i, ORTHO_ROW0: c, ORTHO_ROW_END: end,
                                                                   ORTHO_SLOT0: 0, ORTHO_SLOTS: 0, ORTHO_HEAD: -1,
                                                                   ORTHO_RM: rm, **factor}))
                    self.tiles.append(gram_tiles + -(-(end - c) // chunk) * self.consts["CHUNK_TILES"])
                    self.slot_steps.append(0)
                    self.regram_elems += rows * s.rank if c else 0
                continue
            parts = -(-rows // gram_rows)
            head = slot + parts
            for k in range(parts):
                self.gram_tasks.append(table_row(ORTHO_GRAM_TASK_WIDTH, {
                    GRAM_MAT: i, GRAM_ROW0: k * gram_rows, GRAM_SLOT: slot + k, GRAM_HEAD: head if k == 0 else -1,
                    GRAM_RM: rm, GRAM_N: rows, GRAM_R: s.rank, GRAM_OFF: factor[ORTHO_OFF]}))
            for c in range(0, rows, split):
                self.tasks.append(table_row(ORTHO_TASK_WIDTH, {
                    ORTHO_MAT: i, ORTHO_ROW0: c, ORTHO_ROW_END: min(c + split, rows), ORTHO_SLOT0: slot,
                    ORTHO_SLOTS: parts, ORTHO_HEAD: head, ORTHO_RM: rm, **factor}))
                self.tiles.append(-(-(min(c + split, rows) - c) // chunk) * self.consts["CHUNK_TILES"])
                self.slot_steps.append(-(-parts // self.consts["SLOT_BLOCK"]))
            slot += parts + 1
            self.split_matrices += 1
            self.split_elems += rows * s.rank
        self.slots = slot
        self._device_tables = None

    def device_tables(self, device):
        if self._device_tables is None:
            def dev(rows, width):
                return torch.tensor(rows, dtype=torch.int64).reshape(-1, width).to(device)

            self._device_tables = (dev(self.gram_tasks, ORTHO_GRAM_TASK_WIDTH) if self.gram_tasks else None,
                                   dev(self.tasks, ORTHO_TASK_WIDTH))
        return self._device_tables


def _ortho_plan(layout: BucketLayout, which: str, cfg: dict) -> _OrthoPlan:
    key = (which, padded_rank(layout.max_rank), cfg.get("BLOCK"), cfg.get("SHORT_ROWS"), cfg.get("GRAM_ROWS"),
           cfg.get("SPLIT_ROWS"), cfg.get("APPLY_ROWS"))
    plans = _ORTHO_PLANS.setdefault(layout, {})
    plan = plans.get(key)
    if plan is None:
        plan = _OrthoPlan(layout, which, cfg)
        plans[key] = plan
    return plan


def _ortho_workspace(layout: BucketLayout, slots: int, R: int) -> torch.Tensor:
    """float64 workspace of at least ``slots`` [R, R] Gram slots, kept per layout for reuse."""
    plans = _ORTHO_PLANS.setdefault(layout, {})
    ws = plans.get("workspace")
    need = max(1, slots * R * R)
    if ws is None or ws.numel() < need:
        ws = torch.empty(need, dtype=torch.float64, device=layout.device)
        plans["workspace"] = ws
    return ws


def _overlap(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` shares memory with ``x`` (in place: the hooks orthogonalize P that way)."""
    a, b = x.data_ptr(), out.data_ptr()
    return a < b + out.numel() * out.element_size() and b < a + x.numel() * x.element_size()


def _in_place_config(cfg: dict, in_place: bool) -> dict:
    """``cfg`` without ``APPLY_ROWS`` when the call is in place: every program of a short factor split by
    ``APPLY_ROWS`` reads the whole factor for its Gram (and its first rows for the completion vectors) while the
    other programs of that factor overwrite their rows, so it would read rows already orthogonalized. One program
    per short factor writes the same bits (same tiles, same order) and reads every row before writing any."""
    if in_place and "APPLY_ROWS" in cfg:
        return {k: v for k, v in cfg.items() if k != "APPLY_ROWS"}
    return cfg


def _ortho_inputs(x, layout: BucketLayout, which: str, out, config: Optional[dict], both: bool = False):
    """``(cfg, plan, gram_tasks, tasks, workspace)`` of an :func:`orthogonalize` call: the resolved config (without
    ``APPLY_ROWS`` in place), its plan, the plan's device task tables (``gram_tasks`` None when nothing is split)
    and the float64 Gram workspace (allocated even when unused: one compiled signature), the last three kept with
    the layout. ``both``: the workspace is sized for both factors' plans of this config (a launch plan keeps it:
    the other factor's call then finds it large enough and keeps the same tensor)."""
    cfg = _in_place_config(_resolve("orthogonalize", layout, x.dtype, config), _overlap(x, out))
    plan = _ortho_plan(layout, which, cfg)
    gram_tasks, tasks = plan.device_tables(x.device)
    slots = plan.slots
    if both:
        slots = max(slots, _ortho_plan(layout, "q" if which == "p" else "p", cfg).slots)
    return cfg, plan, gram_tasks, tasks, _ortho_workspace(layout, slots, plan.R)


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float, out, *, config: Optional[dict] = None) -> None:
    """Orthogonalize every P_i (``which="p"``) or Q_i (``"q"``): ONE launch when every factor has at most
    ``SHORT_ROWS`` rows, else two (float64 Gram slots of the split factors, then the rest); see
    :mod:`powersgd_triton.ops.orthogonalization`. Launch plans per layout, factor, config and in-place-ness (as
    :func:`project`'s). Raises ``ValueError`` for a malformed config or another ``which``."""
    a, b = x.data_ptr(), out.data_ptr()  # in place (shared memory): the hooks orthogonalize P that way
    in_place = a < b + out.numel() * out.element_size() and b < a + x.numel() * x.element_size()
    key = ("launch:orthogonalize", which, x.dtype, None if config is None else tuple(config.items()), in_place)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _ortho_launch(x, layout, which, out, config))
    gram, gram_tasks, finish, tasks, ws = plan
    if gram is not None:
        gram(x, ws, gram_tasks)
    finish(x, out, ws, tasks, float(epsilon))


def _ortho_launch(x, layout, which, out, config):
    factor_columns(which)  # validates `which`; the task tables carry each factor's rows, rank and offset
    cfg, plan, gram_tasks, tasks, ws = _ortho_inputs(x, layout, which, out, config, both=True)
    c = plan.consts
    gram = None
    if gram_tasks is not None:
        gram = DirectLaunch(_ortho_gram_kernel, (gram_tasks.shape[0],), dict(
            R=plan.R, BLOCK=c["GRAM_BLOCK"], GROUP_TILES=c["GROUP_TILES"], **_launch_options(cfg)))
    finish = DirectLaunch(_orthogonalize_kernel, (tasks.shape[0],), dict(
        R=plan.R, BLOCK=c["BLOCK"], CHUNK_TILES=c["CHUNK_TILES"], SHORT_CHUNKS=c["SHORT_CHUNKS"],
        APPLY_CHUNKS=c["APPLY_CHUNKS"], SLOT_BLOCK=c["SLOT_BLOCK"], **_launch_options(cfg)))
    return gram, gram_tasks, finish, tasks, ws


def orthogonalize_kept_tensors(x, layout: BucketLayout, which: str, out, *,
                               config: Optional[dict] = None) -> List[torch.Tensor]:
    """The device tensors :func:`orthogonalize` with these arguments uses besides ``x`` and ``out`` and keeps with
    the layout across calls (its task tables and the float64 Gram workspace). They were allocated on the stream
    of the call that made them: a caller that runs orthogonalize on another stream (the next step's Q on a side
    stream: :func:`powersgd_triton.hooks.driver.orthogonalize_next_q`) records that stream on them, so that the caching
    allocator does not hand their memory to that stream's work while the side stream may still use it (when the
    layout is dropped: a bucket rebuild, ``load_state_dict``)."""
    if layout.num_matrices == 0:
        return []
    return [t for t in _ortho_inputs(x, layout, which, out, config)[2:] if t is not None]


def orthogonalize_plan(layout: BucketLayout, which: str, config: Optional[dict] = None, *,
                       in_place: bool = False) -> List[dict]:
    """The launches of one :func:`orthogonalize` call on ``layout`` (``which`` = "p" or "q"), in launch order.

    One dict per launch: ``kernel`` (a :data:`KERNEL_FUNCTIONS` name), ``programs`` (grid size), ``iterations``
    (the most loop trips of one program: tiles of ``BLOCK`` rows, reading and writing, plus steps of
    ``SLOT_BLOCK`` Gram slots), ``rank_steps`` (serial Gram-Schmidt steps on the r x r Gram per program, 0 for
    the Gram launch), ``lookups`` (dependent table loads before a program's loop: 1, its task row, which carries
    the factor's rows, rank and offset), ``split_programs`` (finish launch: programs of split factors),
    ``bytes_read`` / ``bytes_written`` (bytes the loads and stores of the whole launch touch: factor float32,
    Gram slots float64, task tables; a short factor is read twice, the second time likely from L2),
    ``config`` and ``variant`` (``compile_aot(kernel, config, ..., variant=variant)`` compiles exactly this
    launch). ``config=None``: the heuristic (or interpreter) config. ``in_place``: a call with ``out`` sharing
    ``x``'s memory (the hooks' orthogonalization of P), which ignores ``APPLY_ROWS``. Raises ``ValueError`` for
    an unknown ``which`` or a malformed config.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    cfg = dict(_in_place_config(_resolve("orthogonalize", layout, torch.float32, config), in_place))
    if layout.num_matrices == 0:
        return []
    plan = _ortho_plan(layout, which, cfg)
    R = plan.R
    variant: dict = {}  # the task rows carry each factor's rows, rank and offset: P and Q compile the same kernel
    slot_bytes = R * R * 8
    out = []
    if plan.gram_tasks:
        heads = sum(1 for t in plan.gram_tasks if t[GRAM_HEAD] >= 0)
        out.append(dict(
            kernel="orthogonalize_gram", programs=len(plan.gram_tasks), iterations=plan.consts["GROUP_TILES"],
            rank_steps=0, lookups=1,
            bytes_read=4 * plan.split_elems + len(plan.gram_tasks) * 8 * ORTHO_GRAM_TASK_WIDTH
            + heads * 4 * R * R,
            bytes_written=(len(plan.gram_tasks) + heads) * slot_bytes,
            config=dict(cfg), variant=dict(variant), dtype="float32", max_rank=layout.max_rank,
        ))
    short_elems = plan.factor_elems - plan.split_elems
    out.append(dict(
        kernel="orthogonalize", programs=len(plan.tasks),
        iterations=max(t + k for t, k in zip(plan.tiles, plan.slot_steps)), rank_steps=R, lookups=1,
        bytes_read=8 * short_elems + 4 * plan.split_elems + len(plan.tasks) * 8 * ORTHO_TASK_WIDTH
        + sum(t[ORTHO_SLOTS] * slot_bytes for t in plan.tasks if t[ORTHO_SLOTS] > 0),
        bytes_written=4 * plan.factor_elems, l2_bytes=4 * plan.regram_elems,
        config=dict(cfg), variant=dict(variant, WITH_GRAM=False), dtype="float32", max_rank=layout.max_rank,
        split_programs=sum(1 for t in plan.tasks if t[ORTHO_SLOTS] > 0),
    ))
    return out
