"""What :class:`~powersgd_triton.PowerSGDState` keeps per bucket, and how that memory is allocated.

* :class:`BucketMemory`: one bucket index's layout, error memory, P, Q and work buffers (what each holds: the
  :mod:`powersgd_triton.state.powersgd_state` docstring);
* :class:`BucketMemories`: ``state.buckets``, the bucket index -> :class:`BucketMemory` dict, with the bookkeeping
  that keeps it matched to DDP's buckets (used by :mod:`powersgd_triton.state.buckets`);
* :func:`allocate`, :func:`adopt_loaded`: the tensors of one memory, on the bucket's
  device, in :func:`memory_dtype`; :func:`follow_error_feedback`: the error memory after ``use_error_feedback``
  changed;
* :func:`draw_q`: PyTorch's random initial Q.
"""

import weakref  # noqa: F401 - named in an annotation
from typing import Dict, List, Optional, Tuple

import torch

from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops.backend import steps_for


def memory_dtype(bucket_dtype: torch.dtype) -> torch.dtype:
    """dtype of the error memory, P and Q of a bucket of ``bucket_dtype``: float64 for float64 buckets (computed in
    float64, as PyTorch's hook does), float32 for the others (float16/bfloat16 buckets are accumulated in float32)."""
    return torch.float64 if bucket_dtype == torch.float64 else torch.float32


class BucketMemory:
    """Everything the state keeps for one bucket index (see the module docstring)."""

    __slots__ = (
        "layout", "signature", "backend", "configs", "steps", "error", "p", "q", "q_work", "q_initialized",
        "q_predrawn", "q_next",
        "phase", "comm", "local", "p_work", "p_comm", "q_comm", "draws_q_each_step",
        "params", "param_names", "matrices", "strict", "verified", "order", "order_params", "shapes",
        "verify_pending",
    )

    def __init__(self):
        self.layout: Optional[BucketLayout] = None
        self.signature: Optional[str] = None  # repr(layout.signature); kept when the layout is not (after a load)
        # The bucket's parameters (``bucket.parameters()``, nn.Parameter objects) when the layout was built; None for
        # duck-typed buckets whose parameters are not nn.Parameters. Keys of the per-parameter memory migration.
        self.params: Optional[Tuple[torch.Tensor, ...]] = None
        # What the last full layout check passed with, for real DDP buckets (``params`` not None): the buffer's
        # ``(data_ptr, numel, dtype)``, the rank, min_compression_rate and the parameters' shapes. The same parameter
        # objects with the same shapes in the same order in the same buffer have the same gradient views (DDP places
        # them by the parameters' order and shapes), so the next calls skip the per-gradient check while this key
        # holds. (Shapes too: a parameter reshaped in place, ``w.data = w.data.reshape(...)``, then a new DDP whose
        # bucket buffer reuses the old address, keeps the objects, the numel and the pointer.)
        self.verified: Optional[tuple] = None
        # Loaded, not yet adopted memory only: parameter names per gradient (None where unknown), and the packing
        # table ``(grad_index, n, m, rank, p_offset, q_offset, e_offset)`` per compressed matrix.
        self.param_names: Optional[Tuple[Optional[str], ...]] = None
        self.matrices: Optional[List[Tuple[int, ...]]] = None
        self.strict: bool = False  # loaded with strict checks (powersgd_triton.checkpoint.load_hook_state)
        # Batched hook only: the bucket's parameters in the order its memory was built for (the flat s x s matrix is
        # their gradients back to back), None when unknown; `order`: (offset, numel) of each of their gradients in
        # the live bucket buffer, in that order, when the live bucket holds them in another order (a fresh DDP's
        # first buckets), else None; `shapes`: loaded, not yet adopted memory only, their gradient shapes.
        self.order_params: Optional[Tuple[torch.Tensor, ...]] = None
        self.order: Optional[List[Tuple[int, int]]] = None
        self.shapes: Optional[Tuple[Tuple[int, ...], ...]] = None
        # the backend that runs this bucket (resolved for its device and dtype), the Triton kernels' configs for its
        # layout ({kernel name: config}; empty on torch) and the numeric steps made for both: set together by use()
        self.backend: str = "torch"
        self.configs: Dict[str, Optional[dict]] = {}
        # every hook calls mem.steps.<step>(...) and never chooses a backend itself
        self.steps = steps_for("torch")
        # The next compressed step asks powersgd_triton.ops.verify whether to check the Triton kernels (set again when
        # the backend or the configs are chosen, and when ``state.verify`` is set); False: one attribute test a step.
        self.verify_pending: bool = True
        self.error: Optional[torch.Tensor] = None
        self.p: Optional[torch.Tensor] = None
        self.q: Optional[torch.Tensor] = None
        self.q_work: Optional[torch.Tensor] = None
        self.q_initialized: bool = False
        # `q` holds the random Q the next step would draw, drawn ahead for a state dict (powersgd_triton.state.predraw;
        # loaded memory only): that step takes it instead of drawing, also without warm start; then False.
        self.q_predrawn: bool = False
        # The next step's Q, orthogonalized ahead into `q_work` after a step that kept its Q (not saved): the
        # :class:`powersgd_triton.hooks.driver.NextQ` that says from which `q` it was made, or None (see
        # powersgd_triton.hooks.driver.orthogonalize_next_q).
        self.q_next = None
        # The factor the next compressed step computes first ("p" or "q"; saved): "p" for the hooks that compute
        # both in each step; a hook of half-steps flips it. `comm`, `local`, `p_work`: transient work buffers in the
        # memory's dtype (not saved), allocated by the hook whose step class uses them (its docstring says how).
        self.phase: str = "p"
        self.comm: Optional[torch.Tensor] = None
        self.local: Optional[torch.Tensor] = None
        self.p_work: Optional[torch.Tensor] = None
        # Without warm start, this memory's steps draw a fresh random Q each (PyTorch's hooks; the hook's
        # HookStep.draws_q_each_step, set at each compressed call; not saved): the state dict draws them ahead.
        self.draws_q_each_step: bool = True
        # Layer-wise and batched hooks on the Triton backend, when P and Q travel in another dtype than the
        # memory's: P and Q in that dtype, written by the kernels and all-reduced there (see p_comm, q_comm; not
        # saved).
        self.p_comm: Optional[torch.Tensor] = None
        self.q_comm: Optional[torch.Tensor] = None

    def drop_next_q(self) -> None:
        """:func:`drop_next_q` of this memory (what :mod:`powersgd_triton.ops.verify` calls: ops never import
        state)."""
        drop_next_q(self)

    def use(self, backend: str, configs: Optional[Dict[str, Optional[dict]]] = None) -> None:
        """Run this bucket on ``backend`` (``"triton"`` or ``"torch"``) with ``configs``: the one object of its
        numeric steps, ``steps`` (:class:`~powersgd_triton.ops.backend.TritonSteps` or
        :class:`~powersgd_triton.ops.backend.TorchSteps`), is made here, when the memory is prepared."""
        self.backend = backend
        self.configs = configs if configs is not None else {}
        self.steps = steps_for(backend, self.configs)

    def config(self, kernel: str) -> Optional[dict]:
        return self.configs.get(kernel)

    def nbytes(self) -> int:
        """Persistent bytes held for this bucket (error, P, Q, work and communication buffers)."""
        tensors = (self.error, self.p, self.q, self.q_work, self.comm, self.local, self.p_work, self.p_comm,
                   self.q_comm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class BucketMemories(dict):
    """``state.buckets``: bucket index -> :class:`BucketMemory` (a dict), plus what keeps it matched to DDP's buckets.

    The bookkeeping attributes (read and written by :mod:`powersgd_triton.state.buckets` and
    :mod:`powersgd_triton.state.state_dict`; none is saved as such):

    * ``retired``: memories replaced during the current iteration (other buckets may still migrate from them);
    * ``seen``: bucket indices prepared in the current iteration; ``layout_changed``: a layout changed in it;
    * ``world_size``, ``rank``: of the process group the memory was built in (None before the first compressed
      step); ``loaded_world_size``, ``loaded_rank``: what a loaded state was saved with, until it is checked;
    * ``names_by_param`` (id -> name), ``params_by_name``: the bound model's parameter names;
      ``unnameable``: parameters no registered DDP module could name (not searched again);
    * ``backend_devices``: devices where ``backend="triton"`` was found to run (checked once each);
    * ``index_params``: per bucket index, weak references to its parameters at the last warm-up call (a second DDP
      model on the same state is refused: ``powersgd_triton.state.models.check_one_model``);
    * ``group_checked``: the process group (resolved: None is WORLD) last compared with the DDP model's
      (``powersgd_triton.state.models.check_bucket_group``), None before the first hook call: the hooks compare it
      by identity with the state's group at every call and check again when ``state.process_group`` changed.
    * ``fsdp_model``: a weak reference to the model ``register_fsdp`` / ``register_replicate`` registered the state on
      (a second live model is refused: ``powersgd_triton.fsdp.checks.check_state_free``).
    """

    def __init__(self):
        super().__init__()
        self.retired: List[BucketMemory] = []
        self.seen: set = set()
        self.layout_changed = False
        self.world_size: Optional[int] = None
        self.rank: Optional[int] = None
        self.loaded_world_size: Optional[int] = None
        self.loaded_rank: Optional[int] = None
        self.names_by_param: Dict[int, str] = {}
        self.params_by_name: Dict[str, torch.Tensor] = {}
        self.unnameable: Dict[int, "weakref.ref"] = {}
        self.backend_devices: set = set()
        # bucket index -> weak references to its parameters at the last warm-up call (_models.check_one_model)
        self.index_params: Dict[int, tuple] = {}
        # bucket index -> (bucket dtype, batched, draws_q_each_step: of the hook) at the last warm-up call
        # (with index_params: the first compressed step's draws, made ahead for a state dict; powersgd_triton.state.predraw)
        self.index_dtypes: Dict[int, tuple] = {}
        # the process group last compared with the DDP model's (_models.check_bucket_group), None before the first call
        self.group_checked = None
        # weakref to the model register_fsdp / register_replicate registered the state on (_fsdp_checks.claim_state)
        self.fsdp_model = None

    def replace_loaded(self, memories: Dict[int, BucketMemory], world_size: Optional[int],
                       rank: Optional[int]) -> None:
        """Drop every memory and what the current iteration replaced; hold ``memories`` (loaded, not yet adopted),
        saved with ``world_size`` and ``rank``. The model's parameter names are kept."""
        self.clear()
        self.update(memories)
        self.retired = []
        self.seen = set()
        self.layout_changed = False
        self.loaded_world_size = world_size
        self.loaded_rank = rank


def allocate(mem: BucketMemory, layout: BucketLayout, buffer: torch.Tensor, use_error_feedback: bool) -> None:
    """Fresh memory for ``layout``: zero error (with error feedback), zero P and Q, an uninitialized ``q_work``."""
    drop_next_q(mem)
    f32 = dict(device=buffer.device, dtype=memory_dtype(buffer.dtype))
    mem.error = torch.zeros(layout.e_numel, **f32) if use_error_feedback else None
    mem.p = torch.zeros(layout.p_numel, **f32)
    mem.q = torch.zeros(layout.q_numel, **f32)
    mem.q_work = torch.empty(layout.q_numel, **f32)
    mem.q_initialized = False


def follow_error_feedback(mem: BucketMemory, use_error_feedback: bool) -> None:
    """Make ``mem`` follow ``state.use_error_feedback`` as it is now (read at every compressed step, as PyTorch's hook
    does): turned on, a zero error memory (float32, the layout's ``e_numel``) starts; turned off, the error memory is
    freed (no longer added nor updated; ``state_dict()`` then holds none for the bucket, as for a state made with
    ``use_error_feedback=False``; turning it on again starts from zero, where PyTorch's hook would add the error it
    kept from before)."""
    if use_error_feedback:
        if mem.error is None:
            mem.error = torch.zeros(mem.layout.e_numel, device=mem.p.device, dtype=mem.p.dtype)
    else:
        mem.error = None
        mem.local = None


def drop_next_q(mem: BucketMemory) -> None:
    """Forget the Q orthogonalized ahead for the next step (``mem.q_next``), after making the current CUDA stream
    wait for it: whoever calls this is about to write ``q`` or ``q_work``, which that work may still read or write."""
    if mem.q_next is not None:
        mem.q_next.wait()
        mem.q_next = None


def adopt_loaded(mem: BucketMemory, layout: BucketLayout, buffer: torch.Tensor, use_error_feedback: bool) -> None:
    """Move loaded memory onto the bucket's device; allocate whatever the load did not provide."""
    f32 = dict(device=buffer.device, dtype=memory_dtype(buffer.dtype))

    def fit(t: Optional[torch.Tensor], numel: int, zero: bool) -> torch.Tensor:
        if t is not None and t.numel() == numel:
            return t.to(**f32).contiguous()
        return torch.zeros(numel, **f32) if zero else torch.empty(numel, **f32)

    if use_error_feedback:
        mem.error = fit(mem.error, layout.e_numel, True)
    else:
        mem.error = None
    mem.p = fit(mem.p, layout.p_numel, True)
    if mem.q is None or mem.q.numel() != layout.q_numel:
        mem.q_initialized = mem.q_predrawn = False
    mem.q = fit(mem.q, layout.q_numel, True)
    drop_next_q(mem)
    mem.q_work = torch.empty(layout.q_numel, **f32)


def p_work(mem: BucketMemory) -> torch.Tensor:
    """``mem.p_work``, allocated like ``mem.p`` when missing or of another size: the layer-wise and batched hooks
    all-reduce P there (or copy it there from ``p_comm`` after its all-reduce) and orthogonalize it into ``mem.p``
    (out of place: the orthogonalize launch may split a factor's rows over programs that all read the whole factor;
    a hook's step class may use it as its own work buffer)."""
    if mem.p_work is None or mem.p_work.numel() != mem.p.numel() or mem.p_work.device != mem.p.device \
            or mem.p_work.dtype != mem.p.dtype:
        mem.p_work = torch.empty_like(mem.p)
    return mem.p_work


def _comm_buffer(mem: BucketMemory, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mem.<name>``: a flat buffer of ``like``'s size and device in ``dtype``, allocated when missing or of another
    size, device or dtype."""
    t = getattr(mem, name)
    if t is None or t.numel() != like.numel() or t.device != like.device or t.dtype != dtype:
        t = torch.empty(like.numel(), device=like.device, dtype=dtype)
        setattr(mem, name, t)
    return t


def p_comm(mem: BucketMemory, dtype: torch.dtype) -> torch.Tensor:
    """``mem.p_comm``: P of the step in flight in the communication dtype ``dtype`` (the layer-wise and batched
    hooks on the Triton backend, when it is not the memory's): ``project`` writes P there rounded as ``Tensor.to``
    rounds, it is all-reduced as it is, then copied into the float32 ``p_work`` that ``orthogonalize`` reads (one
    copy, no cast)."""
    return _comm_buffer(mem, "p_comm", mem.p, dtype)


def q_comm(mem: BucketMemory, dtype: torch.dtype) -> torch.Tensor:
    """``mem.q_comm``: Q of the step in flight in the communication dtype ``dtype`` (the layer-wise and batched
    hooks on the Triton backend, when it is not the memory's): ``project_t`` writes Q there rounded as ``Tensor.to``
    rounds, it is all-reduced as it is, and ``average`` divides it by the world size into ``mem.q_work`` (float32):
    no cast and no copy back."""
    return _comm_buffer(mem, "q_comm", mem.q_work, dtype)


def draw_q(state, mem: BucketMemory, dtype: torch.dtype) -> None:
    """Fill ``mem.q`` with PyTorch's random initial Q (not yet orthogonalized); consumes one seed of ``state.rng``.

    PyTorch seeds a forked CPU RNG with ``rng.randint(1_000_000_000)`` and draws ``randn`` in the bucket's dtype
    per compressed matrix (``(1, m, r)``), per shape group (``(B, m, r)``) with
    ``batch_tensors_with_same_shape``, or ``(s, r)`` for the batched hook. The draw happens on the CPU and
    reaches the device in ONE copy. The seed is consumed even when the bucket compresses nothing, as PyTorch does.
    """
    seed = int(state.rng.randint(1_000_000_000))
    layout = mem.layout
    mem.q_initialized = True
    drop_next_q(mem)
    if layout.q_numel == 0:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        chunks = []
        if layout.batched:
            s = layout.matrices[0]
            chunks.append(torch.randn(s.m, s.rank, device="cpu", dtype=dtype))
        elif state.batch_tensors_with_same_shape:
            for g in layout.groups:
                chunks.append(torch.randn(g.count, g.m, g.rank, device="cpu", dtype=dtype))
        else:
            for s in layout.matrices:
                chunks.append(torch.randn(1, s.m, s.rank, device="cpu", dtype=dtype))
    host = torch.cat([c.reshape(-1) for c in chunks]).to(mem.q.dtype)
    mem.q.copy_(host)
