"""Run every interpreted Triton launch's programs in another order: reversed, or shuffled with a seed.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the programs of a launch one after another in their natural order
(``x`` outermost, then ``y``, then ``z``), each to its end. A kernel whose result depends on the order of its programs
(one program reads what another writes in the same launch: a cross-program race on a GPU) therefore gives the same
numbers every run there, and no test sees the race. :func:`program_order` makes the interpreter run the same
programs, each exactly once, in another order; a launch whose outputs then differ from the natural order's has such
a dependence. :func:`assert_order_independent` runs a piece of work in several orders and compares the outputs
bitwise.

How: the interpreter's grid loop (``GridExecutor.__call__`` in ``triton/runtime/interpreter.py``, triton 3.6 to 3.9)
calls ``interpreter_builder.set_grid_dim(nx, ny, nz)`` once per launch and then ``set_grid_idx(x, y, z)`` before
each program, in natural order; ``tl.program_id`` reads the index set last. The patch (:func:`_install`, the only
version-dependent code here) wraps both methods on that builder: the k-th ``set_grid_idx`` call of a launch sets the
k-th index of the permuted order instead. It checks on every call that the loop still counts in natural order and,
at the end of each launch, that every program ran once, and :func:`check_supported` runs a probe kernel that records
the order its programs ran in; any other interpreter structure is a ``RuntimeError`` naming what was not found.
"""

import contextlib
import os
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

ORDERS = ("natural", "reversed", "shuffled")


@dataclass
class OrderStats:
    """What ran under :func:`program_order`: per kernel function name, the launches and the launches of more than
    one program (the ones whose order was changed)."""

    order: str
    launches: Dict[str, int] = field(default_factory=dict)
    reordered: Dict[str, int] = field(default_factory=dict)
    programs: Dict[str, List[int]] = field(default_factory=dict)  # the grid size of each launch, in launch order

    def note(self, name: str, programs: int) -> None:
        self.launches[name] = self.launches.get(name, 0) + 1
        self.programs.setdefault(name, []).append(programs)
        if programs > 1:
            self.reordered[name] = self.reordered.get(name, 0) + 1


class _Active:
    """The order in force and the launch being run (one at a time: the interpreter's builder is one global)."""

    def __init__(self, order: str, seed: int, stats: OrderStats):
        self.order, self.seed, self.stats = order, seed, stats
        self.launch = 0
        self.natural: List[Tuple[int, int, int]] = []
        self.permuted: List[Tuple[int, int, int]] = []
        self.next = 0

    def begin(self, nx: int, ny: int, nz: int) -> None:
        self.natural = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        self.permuted = list(self.natural)
        if self.order == "reversed":
            self.permuted.reverse()
        elif self.order == "shuffled":
            random.Random(self.seed * 1_000_003 + self.launch).shuffle(self.permuted)
        elif self.order != "natural":
            raise ValueError(f"program order must be one of {ORDERS}, got {self.order!r}")
        self.launch += 1
        self.next = 0

    def index(self, x: int, y: int, z: int) -> Tuple[int, int, int]:
        k = self.next
        if not 0 <= k < len(self.natural) or self.natural[k] != (x, y, z):
            want = self.natural[k] if 0 <= k < len(self.natural) else "none (no set_grid_dim, or all programs ran)"
            raise RuntimeError(
                f"_program_order: the interpreter's grid loop set program index {(x, y, z)} as call {k} of a grid of "
                f"{len(self.natural)} programs; natural order expects {want}. Triton's GridExecutor.__call__ changed: "
                "update tests/_program_order.py (_install)")
        self.next = k + 1
        return self.permuted[k]


class OrderDependenceError(AssertionError):
    """Outputs of a run in another program order differ from the natural order's (:func:`assert_order_independent`)."""


_ACTIVE: Optional[_Active] = None
_INSTALLED = False


def _interpreter():
    """The interpreter module, its builder, and its GridExecutor class; ``RuntimeError`` naming what is missing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("_program_order needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")
    import triton
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    missing = [what for what, ok in (
        ("triton.runtime.interpreter.interpreter_builder", builder is not None),
        ("interpreter_builder.set_grid_dim", callable(getattr(builder, "set_grid_dim", None))),
        ("interpreter_builder.set_grid_idx", callable(getattr(builder, "set_grid_idx", None))),
        ("triton.runtime.interpreter.GridExecutor.__call__", callable(getattr(executor, "__call__", None))),
    ) if not ok]
    if missing:
        raise RuntimeError(f"_program_order: triton {triton.__version__}'s interpreter has no {', '.join(missing)} "
                           "(known structure: triton 3.6-3.9); update tests/_program_order.py (_install)")
    return interpreter, builder, executor


def _install() -> None:
    """Wrap the interpreter builder's ``set_grid_dim``/``set_grid_idx`` and ``GridExecutor.__call__`` once, for the
    whole process; with no :func:`program_order` block active they pass straight through."""
    global _INSTALLED
    if _INSTALLED:
        return
    _, builder, executor = _interpreter()
    set_dim, set_idx, call = builder.set_grid_dim, builder.set_grid_idx, executor.__call__

    def set_grid_dim(nx, ny, nz):
        if _ACTIVE is not None:
            _ACTIVE.begin(int(nx), int(ny), int(nz))
        return set_dim(nx, ny, nz)

    def set_grid_idx(x, y, z):
        if _ACTIVE is not None:
            x, y, z = _ACTIVE.index(int(x), int(y), int(z))
        return set_idx(x, y, z)

    def grid_call(self, *args, **kwargs):
        active = _ACTIVE
        if active is None:
            return call(self, *args, **kwargs)
        active.natural, active.next = [], -1  # set_grid_dim must come (and reset it) before any program
        out = call(self, *args, **kwargs)
        if active.next != len(active.natural):
            raise RuntimeError(
                f"_program_order: a launch of {getattr(self.fn, '__name__', self.fn)} ran {max(active.next, 0)} of "
                f"{len(active.natural)} programs through set_grid_idx (or never called set_grid_dim); Triton's "
                "GridExecutor.__call__ changed: update tests/_program_order.py (_install)")
        active.stats.note(getattr(self.fn, "__name__", str(self.fn)), len(active.natural))
        return out

    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    executor.__call__ = grid_call
    _INSTALLED = True


@contextlib.contextmanager
def program_order(order: str, seed: int = 0):
    """Within the block, every interpreted launch runs its programs in ``order`` (one of :data:`ORDERS`;
    ``"shuffled"``: a permutation drawn from ``seed`` and the launch's number in the block). Yields an
    :class:`OrderStats` of the launches. Not reentrant. Raises ``RuntimeError`` without the interpreter or when its
    grid loop is not the one this module knows."""
    global _ACTIVE
    if order not in ORDERS:
        raise ValueError(f"program order must be one of {ORDERS}, got {order!r}")
    if _ACTIVE is not None:
        raise RuntimeError("program_order blocks do not nest")
    _install()
    stats = OrderStats(order)
    _ACTIVE = _Active(order, seed, stats)
    try:
        yield stats
    finally:
        _ACTIVE = None


_CHECKED: Optional[str] = None


def check_supported() -> None:
    """Run a probe kernel of 4 x 2 x 3 programs under each order, each program writing the order it ran in (an
    atomic ticket) to its slot; ``RuntimeError`` unless the programs ran in exactly the order asked, each once."""
    global _CHECKED
    if _CHECKED is not None:
        return
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(ticket, ran):
        pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        tl.store(ran + tl.atomic_add(ticket, 1), pid)

    grid = (4, 2, 3)
    natural = [(x * grid[1] + y) * grid[2] + z for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
    for order in ORDERS:
        ticket, ran = torch.zeros(1, dtype=torch.int32), torch.full((len(natural),), -1, dtype=torch.int32)
        with program_order(order, seed=5):
            _probe[grid](ticket, ran)
        got = ran.tolist()
        want = {"natural": natural, "reversed": natural[::-1]}.get(order)
        if sorted(got) != natural or (want is not None and got != want) or (want is None and got == natural):
            raise RuntimeError(f"_program_order: under {order!r} the probe's programs ran as {got} (triton "
                               f"{triton.__version__}); update tests/_program_order.py (_install)")
    _CHECKED = triton.__version__


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (NaNs of the same bits compare equal; -0.0 and 0.0 do not)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_order_independent(run: Callable[[], Sequence[torch.Tensor]], *, seeds: Sequence[int] = (1,),
                             expect: Sequence[str] = ()) -> Dict[str, OrderStats]:
    """Call ``run()`` (fresh inputs each call: it must not depend on the previous call) in natural order, reversed,
    and shuffled under each of ``seeds``; fails unless every call's tensors are bitwise those of the natural order's
    call, and unless every kernel function named in ``expect`` had a launch of more than one
    program (a reordering that changed nothing would make the check vacuous). A difference is an
    :class:`OrderDependenceError` (an ``AssertionError``). Returns the stats per order."""
    check_supported()
    with program_order("natural") as stats:
        want = [_bits(t).clone() for t in run()]
    out = {"natural": stats}
    for order, seed in [("reversed", 0)] + [("shuffled", s) for s in seeds]:
        with program_order(order, seed) as stats:
            got = [_bits(t) for t in run()]
        name = order if order == "reversed" else f"shuffled(seed={seed})"
        assert len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want)):
            if not torch.equal(a, b):
                diff = int((a != b).sum()) if a.shape == b.shape else "shape"
                raise OrderDependenceError(f"output {i} differs under {name} program order from the natural "
                                           f"order ({diff} bytes differ; launches: {stats.launches})")
        out[name] = stats
    missing = [k for k in expect if not out["natural"].reordered.get(k)]
    assert not missing, f"no launch of more than one program of {missing}: {out['natural'].launches}"
    return out
