"""torchft: ``PowerSGDDiLoCo``, torchft's (Streaming) DiLoCo with PowerSGD-compressed outer gradients.

torchft (meta-pytorch/torchft) runs DiLoCo across replica groups that may fail and rejoin: a ``Manager`` keeps the
quorum through a lighthouse, all-reduces fault-tolerantly (an error turns the rest of the step's all-reduces into
no-ops and makes ``should_commit()`` false) and heals a joining replica from a peer's state dict.
:class:`PowerSGDDiLoCo` is ``torchft.local_sgd.DiLoCo`` whose outer-gradient all-reduce is replaced, per fragment,
by :class:`~powersgd_triton.integrations.outer_powersgd.OuterPowerSGD` (P, orthogonalize, Q, ``P·Qᵀ``, error
feedback and warm start, the numeric steps of our DDP hooks), every all-reduce through ``Manager.allreduce`` (so
quorum, participation and errors stay torchft's). Example::

    from powersgd_triton import PowerSGDState
    from powersgd_triton.integrations.torchft import PowerSGDDiLoCo

    state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                          communication_dtype=torch.bfloat16)
    with PowerSGDDiLoCo(manager, [model], inner_opt, outer_opt, sync_every=20, state=state) as diloco:
        for batch in data:  # inner steps; every 20th inner_opt.step() syncs (compressed)
            ...

Faults, as torchft defines them:

* a sync that errors or whose ``should_commit()`` is false discards the outer step (torchft restores the
  parameters); the error memory and Q of every bucket of the fragment are put back as they were before the sync;
* a replica that recovers from a peer (torchft's healing, at the quorum of a sync) loads the peer's warm-start Q (so
  every replica projects on the same Q, which all-reducing Q keeps equal after every committed sync) and starts with
  a **zero error memory** (the error is per replica; the peer's would count the peer's residual twice). The state
  dict registered with the manager (key ``PowerSGDDiLoCo_<fragment>``) holds Q only, for that reason;
  :meth:`PowerSGDDiLoCo.state_dict` holds Q and the error memory, for your own checkpoints of a replica;
* a replica that does not participate in a sync (torchft zeroes what it sends) keeps its error memory;
* which all-reduces run depends only on the parameters' shapes and the settings: replicas never disagree on them.

Streaming DiLoCo (several fragments, ``fragment_sync_delay``, ``fragment_update_alpha``): one compressor, with its
own memory, per fragment. With ``fragment_sync_delay > 0`` the Q all-reduce overlaps the delayed inner steps; P's
all-reduce is waited for at the preparation step (orthogonalizing P needs it).

Tested with torchft 0.2.0 (gloo, CPU). Reads torchft's fragment internals ``_average_grads``, ``_grads``,
``perform_sync``, ``_allreduce_work`` and ``_stream`` (checked when constructed). This module imports ``torchft`` when
it is imported itself (``import powersgd_triton`` does not).
"""

from typing import List, Optional

import torch
from torch.distributed import ReduceOp

try:
    from torchft.local_sgd import DiLoCo
    from torchft.utils import get_stream_context
except ImportError as exc:  # pragma: no cover - exercised where torchft is absent
    raise ImportError(
        "powersgd_triton.integrations.torchft needs torchft (pip install 'powersgd-triton[torchft]')"
    ) from exc

from powersgd_triton.integrations.outer_powersgd import DEFAULT_BUCKET_CAP_MB, OuterPowerSGD
from powersgd_triton.state.powersgd_state import PowerSGDState

__all__ = ["PowerSGDDiLoCo", "ManagerComm", "STATE_KEY"]

STATE_KEY = "PowerSGDDiLoCo_{}"  # the key of fragment i's entry in the manager's state dict
_FRAGMENT_API = ("_average_grads", "_grads", "perform_sync", "_allreduce_work", "_model_fragment", "_fragment_id")


class ManagerComm:
    """The ``comm`` of :class:`~powersgd_triton.integrations.outer_powersgd.OuterPowerSGD` on a torchft ``Manager``:
    ``Manager.allreduce(tensor, reduce_op=SUM)`` (fault tolerant: errors are the manager's), its participants."""

    __slots__ = ("manager",)

    def __init__(self, manager):
        self.manager = manager

    def allreduce(self, tensor: torch.Tensor):
        return self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)

    def num_participants(self) -> int:
        return self.manager.num_participants()

    def is_participating(self) -> bool:
        return self.manager.is_participating()


class _Done:
    """A finished work (a fragment with nothing to all-reduce: torchft's ``perform_sync`` expects one)."""

    def wait(self, timeout=None) -> bool:
        return True


class PowerSGDDiLoCo(DiLoCo):
    """``torchft.local_sgd.DiLoCo`` with PowerSGD on the outer gradients (module docstring).

    Args:
        manager, model_fragments, inner_optimizer, outer_optimizer, sync_every: as ``DiLoCo``'s.
        state: a :class:`~powersgd_triton.PowerSGDState` (settings read:
            :class:`~powersgd_triton.integrations.outer_powersgd.OuterPowerSGD`); default: rank 4, bfloat16
            factors on the wire, error feedback and warm start.
        bucket_cap_mb: our bucket size (MiB) for the outer gradients of a fragment.
        start_compression_sync: outer syncs at manager steps below this are all-reduced uncompressed.
        **kwargs: ``DiLoCo``'s other arguments (``backup_device``, ``pin_memory``, ``fragment_sync_delay``,
            ``fragment_update_alpha``); ``should_quantize`` and ``use_bucketization`` are refused (the outer
            gradients are compressed here instead).

    Attributes:
        compressors: one :class:`~powersgd_triton.integrations.outer_powersgd.OuterPowerSGD` per fragment.
        outer_syncs: committed outer syncs; ``failed_syncs``: discarded ones (errors, ``should_commit()`` false).
        last_sync: ``(fragment index, committed)`` of the last sync, or None.

    Raises:
        ValueError: ``should_quantize`` or ``use_bucketization`` given; what ``DiLoCo`` and ``OuterPowerSGD`` raise.
        TypeError: ``state`` is not a :class:`~powersgd_triton.PowerSGDState`.
        RuntimeError: this torchft's fragments lack an attribute this class relies on (names it).
    """

    def __init__(self, manager, model_fragments, inner_optimizer, outer_optimizer, sync_every: int, *,
                 state: Optional[PowerSGDState] = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 start_compression_sync: int = 0, **kwargs):
        for name in ("should_quantize", "use_bucketization"):
            if kwargs.pop(name, False):
                raise ValueError(f"PowerSGDDiLoCo compresses the outer gradients itself: {name}=True is refused")
        if state is None:
            state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                  communication_dtype=torch.bfloat16)
        if not isinstance(state, PowerSGDState):
            raise TypeError(f"state must be a powersgd_triton.PowerSGDState, got {type(state).__name__}")
        super().__init__(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every, **kwargs)
        self.state = state
        self.outer_syncs = 0
        self.failed_syncs = 0
        self.last_sync = None
        self.compressors: List[OuterPowerSGD] = []
        for frag in self._fragments:
            missing = [a for a in _FRAGMENT_API if not hasattr(frag, a)]
            if missing:
                raise RuntimeError(f"this torchft's DiLoCo fragments lack {missing}: PowerSGDDiLoCo was written "
                                   "against torchft 0.2.0")
            named = [(n, _local(p)) for n, p in frag._model_fragment.named_parameters()]
            comp = OuterPowerSGD(state, named, frag._fragment_id, bucket_cap_mb, start_compression_sync)
            self.compressors.append(comp)
            frag._average_grads = self._begin_fn(frag, comp)
            frag.perform_sync = self._perform_fn(frag, comp, frag.perform_sync)
            manager.register_state_dict_fn(STATE_KEY.format(frag._fragment_id), self._load_fn(comp),
                                           self._save_fn(comp))

    # ---------------------------------------------------------------- the fragments' sync, replaced
    def _begin_fn(self, frag, comp: OuterPowerSGD):
        def average_grads() -> None:  # called by prepare_sync on the fragment's stream, after _save_grads
            comp.begin(frag._grads, ManagerComm(self._manager), self._manager.current_step())
            frag._allreduce_work.extend(comp.works if comp.works else [_Done()])

        return average_grads

    def _perform_fn(self, frag, comp: OuterPowerSGD, original):
        def perform_sync() -> bool:
            try:
                with get_stream_context(getattr(frag, "_stream", None)):
                    comp.finish(frag._grads)
                committed = bool(original())
            except BaseException:
                comp.settle(False)
                self.failed_syncs += 1
                self.last_sync = (frag._fragment_id, False)
                raise
            comp.settle(committed)
            if committed:
                self.outer_syncs += 1
            else:
                self.failed_syncs += 1
            self.last_sync = (frag._fragment_id, committed)
            return committed

        return perform_sync

    @staticmethod
    def _save_fn(comp: OuterPowerSGD):
        def save() -> dict:
            return comp.state_dict(error=False)

        return save

    @staticmethod
    def _load_fn(comp: OuterPowerSGD):
        def load(sd: dict) -> None:  # a replica healing from a peer: the peer's Q, a zero error memory
            comp.load_state_dict(sd, zero_error=True)

        return load

    # ---------------------------------------------------------------- public
    @property
    def allreduce_bytes(self) -> int:
        """Bytes this replica handed to ``Manager.allreduce`` for outer syncs so far (every fragment, every sync)."""
        return sum(c.bytes_sent for c in self.compressors)

    def state_dict(self) -> dict:
        """This replica's memory, for its own checkpoint: per fragment, Q and the error memory (copies)."""
        return {"fragments": [c.state_dict(error=True) for c in self.compressors]}

    def load_state_dict(self, sd: dict) -> None:
        """Load :meth:`state_dict`'s output (every fragment checked before any is changed).

        Raises:
            ValueError: another number of fragments, or what
                :meth:`~powersgd_triton.integrations.outer_powersgd.OuterPowerSGD.load_state_dict` raises.
        """
        frags = sd.get("fragments") if isinstance(sd, dict) else None
        if not isinstance(frags, list) or len(frags) != len(self.compressors):
            raise ValueError(f"expected a state dict of {len(self.compressors)} fragments")
        backups = [c.state_dict(error=True) for c in self.compressors]
        try:
            for c, f in zip(self.compressors, frags):
                c.load_state_dict(f)
        except ValueError:
            for c, b in zip(self.compressors, backups):
                c.load_state_dict(b)
            raise


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local tensor of a parameter (a DTensor's shard, as torchft's outer gradients are)."""
    to_local = getattr(p, "to_local", None)
    return to_local().detach() if callable(to_local) else p.detach()
