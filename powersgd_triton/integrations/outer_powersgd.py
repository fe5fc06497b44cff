"""PowerSGD on outer gradients (DiLoCo): the compressor of one model fragment, framework-free.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) runs H local steps per replica, then all-reduces the *outer
gradient* of every parameter (its value at the last sync minus its value now) and steps an outer optimizer on the
average. :class:`OuterPowerSGD` replaces that all-reduce by PowerSGD (Vogels et al. 2019, arXiv 1905.13727) with
the numeric steps of our DDP hooks (:mod:`powersgd_triton.ops`, through the backend object of
:mod:`powersgd_triton.ops.backend`: Triton kernels on GPU, torch on CPU), on buckets laid out by
:class:`~powersgd_triton.layout.BucketLayout`. Per bucket and sync:

1. the outer gradients are copied into the bucket buffer; the ones PowerSGD does not compress (vectors, small
   matrices: ``min_compression_rate``) are all-reduced as they are (summed, then divided by the participants);
2. ``P = (M + E)·Q`` (``E``: this replica's error memory, ``Q``: the warm start kept from the last sync, or a random
   one), all-reduced (sum) in ``communication_dtype``, orthogonalized;
3. ``Q = (M + E)ᵀ·P``, all-reduced (sum) in ``communication_dtype``, divided by the participants;
4. the outer gradients become ``P·Qᵀ`` (the average of the low-rank projections) and ``E ← M + E − P·Qᵀ``; ``Q`` is
   kept for the next sync (where the step is finite).

Steps 1-2 run in :meth:`OuterPowerSGD.begin` (waiting for P's all-reduce), Q's all-reduce is left in flight; 3-4 run
in :meth:`OuterPowerSGD.finish`. :meth:`OuterPowerSGD.settle` then keeps the new memory (the outer step was
committed) or puts back the error memory and Q of before the sync (it was discarded): a discarded sync leaves no
trace. A replica that does not participate in a sync keeps its error memory as it was (its gradients were not sent).

Which collectives run depends only on the layout (parameter shapes, dtypes, the settings) and on the sync's step,
never on data or on errors: every replica issues the same all-reduces in the same order.

The all-reduces go through ``comm``, an object with ``allreduce(tensor) -> work`` (an in-place **sum**; ``work.wait()``
blocks), ``num_participants() -> int`` and ``is_participating() -> bool``: torchft's ``Manager`` in
:mod:`powersgd_triton.integrations.torchft`.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from powersgd_triton.layout import BucketLayout, check_gradient_dtype
from powersgd_triton.ops.backend import resolve_backend, steps_for
from powersgd_triton.state.memory import memory_dtype

__all__ = ["OuterPowerSGD", "plan_buckets", "initial_q", "DEFAULT_BUCKET_CAP_MB"]

DEFAULT_BUCKET_CAP_MB = 25.0
_STATE_VERSION = 1


def plan_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> List[List[int]]:
    """Indices of ``tensors`` grouped into buckets, in order: consecutive tensors of one dtype and device, at most
    ``cap_bytes`` bytes per bucket (a larger tensor is a bucket of its own); empty tensors are left out."""
    buckets: List[List[int]] = []
    size = 0
    key = None
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        k = (t.dtype, t.device)
        if not buckets or k != key or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
            key = k
        buckets[-1].append(i)
        size += nbytes
    return buckets


def initial_q(random_seed: int, fragment: int, bucket: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The random (not yet orthogonalized) Q a bucket draws at ``step`` (the sync's step, agreed by all replicas):
    ``numel`` standard normal values in ``dtype`` on the CPU, the same on every replica for the same arguments
    (a torch CPU generator seeded from ``(random_seed, fragment, bucket, step)`` by numpy's ``SeedSequence``)."""
    seed = int(np.random.SeedSequence([int(random_seed), int(fragment), int(bucket), int(step)]).generate_state(1)[0])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


class _Bucket:
    """One bucket of a fragment: its parameters' names and views into ``buffer``, the layout, the memory (error
    ``E``, ``P``, warm-start ``Q``, in float32, float64 for float64 gradients), the work buffers of a sync, and the
    copies of ``E`` and ``Q`` taken before it (:meth:`OuterPowerSGD.settle` puts them back)."""

    def __init__(self, index: int, names: List[str], like: List[torch.Tensor], state, use_error_feedback: bool):
        self.index = index
        self.names = names
        self.shapes = [tuple(t.shape) for t in like]
        numel = sum(t.numel() for t in like)
        self.buffer = torch.empty(numel, dtype=like[0].dtype, device=like[0].device)
        self.views = []
        pos = 0
        for t in like:
            self.views.append(self.buffer[pos : pos + t.numel()].view(t.shape))
            pos += t.numel()
        self.layout = BucketLayout.from_gradients(self.buffer, self.views, state.matrix_approximation_rank,
                                                  state.min_compression_rate)
        self.steps = steps_for(resolve_backend(state.backend, self.buffer))
        f = dict(device=self.buffer.device, dtype=memory_dtype(self.buffer.dtype))
        lay = self.layout
        self.error = torch.zeros(lay.e_numel, **f) if use_error_feedback and lay.num_matrices else None
        self.p = torch.zeros(lay.p_numel, **f)
        self.q = torch.zeros(lay.q_numel, **f)
        self.q_initialized = False
        self.p_raw = torch.empty(lay.p_numel, **f)
        self.q_raw = torch.empty(lay.q_numel, **f)
        self.q_work = torch.empty(lay.q_numel, **f)
        wire = state.communication_dtype if state.communication_dtype is not None else self.buffer.dtype
        self.wire = None if wire == f["dtype"] else wire
        self.saved_error = None if self.error is None else torch.empty_like(self.error)
        self.saved_q = torch.empty_like(self.q)
        self.saved_q_initialized = False
        self.unc = self.packed = self.p_send = self.q_send = None
        self.full = False  # this sync all-reduces the whole bucket uncompressed

    def nbytes(self) -> int:
        """Bytes of memory kept between syncs (error, P, Q and their copies), not counting the work buffers."""
        ts = (self.error, self.p, self.q, self.saved_error, self.saved_q)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class OuterPowerSGD:
    """PowerSGD of the outer gradients of one model fragment (module docstring), one per fragment and replica.

    Args:
        state: a :class:`~powersgd_triton.PowerSGDState` whose settings are read where they mean the same as in the
            hooks: ``matrix_approximation_rank``, ``min_compression_rate``, ``use_error_feedback``, ``warm_start``,
            ``orthogonalization_epsilon``, ``random_seed`` (the initial Q, :func:`initial_q`), ``backend``,
            ``communication_dtype`` (P and Q on the wire; None: the parameters' dtype). ``start_powerSGD_iter``,
            ``autotune``, ``verify`` and the DDP statistics are not used (DDP notions); a ``grad_scaler`` is refused.
        named: ``(name, tensor)`` of the fragment's parameters (local tensors: their shapes, dtypes and devices).
        fragment: the fragment's index (seeds the initial Q).
        bucket_cap_mb: bucket size in MiB (:func:`plan_buckets`).
        start_compression_sync: syncs whose step is below this are all-reduced uncompressed (the memory untouched).

    Raises:
        TypeError: a parameter of a dtype PowerSGD cannot compress (complex, integer).
        ValueError: ``state.grad_scaler`` is set; ``bucket_cap_mb`` not positive; ``start_compression_sync`` < 0.
        RuntimeError: ``state.backend == "triton"`` where Triton cannot run on the parameters' device.
    """

    def __init__(self, state, named: Sequence[Tuple[str, torch.Tensor]], fragment: int = 0,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, start_compression_sync: int = 0):
        if state.grad_scaler is not None:
            raise ValueError("outer gradients are not loss-scaled: give a PowerSGDState without grad_scaler")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if int(start_compression_sync) != start_compression_sync or start_compression_sync < 0:
            raise ValueError(f"start_compression_sync must be an int >= 0, got {start_compression_sync}")
        for name, t in named:
            check_gradient_dtype(t.dtype)
        self.state = state
        self.fragment = int(fragment)
        self.start_compression_sync = int(start_compression_sync)
        tensors = [t for _, t in named]
        plan = plan_buckets(tensors, int(bucket_cap_mb * 2**20))
        self.buckets = [_Bucket(b, [named[i][0] for i in idx], [tensors[i] for i in idx], state,
                                bool(state.use_error_feedback)) for b, idx in enumerate(plan)]
        self.works: list = []
        self.world = 1
        self.participating = True
        self.in_flight = False
        self.bytes_sent = 0  # bytes handed to comm.allreduce, every sync, committed or not
        self.last_sync_bytes = 0

    # ---------------------------------------------------------------- a sync
    def begin(self, grads: Dict[str, torch.Tensor], comm, step: int) -> None:
        """Steps 1-2 of the module docstring for every bucket: ``grads`` (name -> outer gradient) copied into the
        buckets, the uncompressed all-reduces issued, P all-reduced (waited for) and orthogonalized, ``Q = (M +
        E)ᵀ·P`` computed and its all-reduce issued; E and Q saved first. ``step``: the sync's step (the same on
        every replica): below ``start_compression_sync`` whole buckets are all-reduced uncompressed.

        Raises:
            KeyError: a parameter of the fragment is missing from ``grads``; RuntimeError: a sync is in flight.
        """
        if self.in_flight:
            raise RuntimeError("a sync of this fragment is in flight: finish() and settle() it first")
        self.works = []
        self.last_sync_bytes = 0
        self.in_flight = True
        full = step < self.start_compression_sync
        first = True
        for b in self.buckets:
            for name, view in zip(b.names, b.views):
                view.copy_(grads[name].reshape(view.shape))
            if b.error is not None:
                b.saved_error.copy_(b.error)
            b.saved_q.copy_(b.q)
            b.saved_q_initialized = b.q_initialized
            b.full = full or b.layout.num_matrices == 0
            b.unc = b.packed = None
            if b.full:
                b.unc = b.buffer
            elif b.layout.uncompressed_numel:
                lay = b.layout
                if len(lay.uncompressed) == 1:
                    o, n = lay.uncompressed[0]
                    b.unc = b.buffer[o : o + n]
                else:
                    b.packed = b.buffer.new_empty(lay.uncompressed_numel)
                    b.steps.pack_uncompressed(b.buffer, lay, b.packed)
                    b.unc = b.packed
            if b.unc is not None:
                self.works.append(self._allreduce(comm, b.unc))
                first = self._read_world(comm, first)
            if b.full:
                continue
            self._compute_p(b, step)
            self._allreduce(comm, b.p_send).wait()
            first = self._read_world(comm, first)
            if b.p_send is not b.p_raw:
                b.p_raw.copy_(b.p_send)
            eps = float(self.state.orthogonalization_epsilon)
            b.steps.orthogonalize(b.p_raw, b.layout, "p", eps, out=b.p)
            b.steps.project_t(b.buffer, b.layout, b.p, b.q_raw)
            b.q_send = b.q_raw if b.wire is None else b.q_raw.to(b.wire)
            self.works.append(self._allreduce(comm, b.q_send))

    def finish(self, grads: Dict[str, torch.Tensor]) -> None:
        """Steps 3-4 for every bucket: wait for the all-reduces, average, ``M ← P·Qᵀ``, the new error memory and Q
        (where the step is finite), and the result copied back into ``grads``' tensors."""
        for w in self.works:
            w.wait()
        self.works = []
        world = self.world
        for b in self.buckets:
            lay = b.layout
            if b.full or lay.num_matrices == 0:
                if b.unc is not None:
                    b.unc.div_(world)
                    if b.packed is not None:
                        b.steps.unpack_uncompressed(b.packed, lay, b.buffer)
            else:
                flags = b.steps.average(b.q_send, lay, "q", b.buffer, b.packed, world, out=b.q_work)
                warm = bool(self.state.warm_start)
                keep = b.error is not None or warm
                b.steps.reconstruct(b.buffer, lay, b.p, b.q_work, 1.0, b.error, flags if keep else None,
                                    commit=("q", b.q) if warm else None)
            for name, view in zip(b.names, b.views):
                grads[name].copy_(view.reshape(grads[name].shape))

    def settle(self, committed: bool) -> None:
        """End of a sync: keep the new memory (``committed``) or put back the error memory and Q saved by
        :meth:`begin` (also on a replica that did not participate: its error memory is kept as it was)."""
        if not self.in_flight:
            return
        self.in_flight = False
        self.works = []
        for b in self.buckets:
            if not committed:
                b.q.copy_(b.saved_q)
                b.q_initialized = b.saved_q_initialized
            if b.error is not None and (not committed or not self.participating or b.full):
                b.error.copy_(b.saved_error)

    def _compute_p(self, b: _Bucket, step: int) -> None:
        state, lay = self.state, b.layout
        if not b.q_initialized or not state.warm_start:
            b.q.copy_(initial_q(state.random_seed, self.fragment, b.index, step, lay.q_numel, b.q.dtype))
            b.q_initialized = True
        eps = float(state.orthogonalization_epsilon)
        b.steps.orthogonalize(b.q, lay, "q", eps, out=b.q_work)
        b.steps.project(b.buffer, lay, b.q_work, b.p_raw, b.error)
        b.p_send = b.p_raw if b.wire is None else b.p_raw.to(b.wire)

    def _allreduce(self, comm, t: torch.Tensor):
        n = t.numel() * t.element_size()
        self.bytes_sent += n
        self.last_sync_bytes += n
        return comm.allreduce(t)

    def _read_world(self, comm, first: bool) -> bool:
        """After the sync's first all-reduce (the quorum is known then): the participants, and whether this replica
        is one of them."""
        if first:
            self.world = max(1, int(comm.num_participants()))
            self.participating = bool(comm.is_participating())
        return False

    # ---------------------------------------------------------------- state
    def nbytes(self) -> int:
        """Bytes of memory this fragment keeps between syncs."""
        return sum(b.nbytes() for b in self.buckets)

    def state_dict(self, error: bool = True) -> dict:
        """Copies of the memory: per bucket its parameter names, ``q`` (the warm-start Q), ``q_initialized`` and, with
        ``error``, the error memory (None without error feedback). Plain types and tensors (``weights_only``)."""
        return {
            "version": _STATE_VERSION,
            "fragment": self.fragment,
            "buckets": [
                {"names": list(b.names), "q": b.q.detach().clone(), "q_initialized": bool(b.q_initialized),
                 "error": None if not error or b.error is None else b.error.detach().clone()}
                for b in self.buckets
            ],
        }

    def load_state_dict(self, sd: dict, zero_error: bool = False) -> None:
        """Load :meth:`state_dict`'s output, checked first (changes nothing on an error). ``zero_error``: the error
        memory becomes zero whatever ``sd`` holds (a replica recovering from a peer: the error is per replica).
        Without ``zero_error``, a bucket whose entry has no error memory keeps its own.

        Raises:
            ValueError: another version, fragment count or parameter names; a tensor of another size, not floating
                point, or not finite; a sync is in flight.
        """
        if self.in_flight:
            raise ValueError("cannot load while a sync is in flight")
        if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION:
            raise ValueError(f"not an OuterPowerSGD state dict of version {_STATE_VERSION}")
        entries = sd.get("buckets")
        if not isinstance(entries, list) or len(entries) != len(self.buckets):
            raise ValueError(f"state dict has {len(entries) if isinstance(entries, list) else '?'} buckets, this "
                             f"fragment {len(self.buckets)}")
        for b, e in zip(self.buckets, entries):
            if list(e.get("names", ())) != b.names:
                raise ValueError(f"bucket {b.index}: saved for parameters {e.get('names')}, this one holds {b.names}")
            _check_tensor(f"bucket {b.index} q", e.get("q"), b.q.numel())
            if e.get("error") is not None and b.error is not None:
                _check_tensor(f"bucket {b.index} error", e["error"], b.error.numel())
        for b, e in zip(self.buckets, entries):
            b.q.copy_(e["q"].reshape(-1))
            b.q_initialized = bool(e.get("q_initialized", True))
            if b.error is not None:
                if zero_error:
                    b.error.zero_()
                elif e.get("error") is not None:
                    b.error.copy_(e["error"].reshape(-1))


def _check_tensor(what: str, t, numel: int) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() != numel:
        raise ValueError(f"{what}: expected a floating-point tensor of {numel} elements, got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, t.numel())}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: holds non-finite values")
