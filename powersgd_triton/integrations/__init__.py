"""Framework integrations: PyTorch Lightning (:mod:`.lightning`), Accelerate (:mod:`.accelerate`), the Transformers
Trainer (:mod:`.transformers`) and torchft (:mod:`.torchft`).

This package imports none of the frameworks: each submodule imports its framework when it is imported itself, and
``import powersgd_triton`` imports none of them. What lives here is framework-free:

* :func:`register` -- ``ddp_model.register_comm_hook(state, hook)`` with the checks the frameworks skip: it refuses
  FSDP-wrapped modules, compiled DDP's python reducer and compiled autograd with an error naming the unsupported
  mode, and it tells the state the names of the model's parameters, so that ``state.state_dict()`` and
  :func:`powersgd_triton.checkpoint.save_hook_state` record which parameter each saved matrix belongs to (the memory
  then follows its parameters when a resumed DDP orders its buckets differently).
"""

import sys

__all__ = ["register", "check_ddp_model", "adopt_grad_scaler"]


def _is_fsdp(model) -> bool:
    """FSDP1 (``FullyShardedDataParallel``) or FSDP2 (``fully_shard``) module; imports nothing new."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        for name in ("FullyShardedDataParallel", "FSDPModule"):
            cls = getattr(fsdp, name, None)
            if isinstance(cls, type) and isinstance(model, cls):
                return True
    return any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for c in type(model).__mro__)


def check_ddp_model(model) -> None:
    """Raise ``TypeError`` unless ``model`` is a ``DistributedDataParallel`` our hooks can run under.

    Refused with a message naming the mode: FSDP (``FullyShardedDataParallel`` / ``fully_shard``), compiled DDP's
    python reducer (``torch._dynamo.config.optimize_ddp = "python_reducer"``, which calls comm hooks per parameter),
    compiled autograd (``torch._dynamo.config.compiled_autograd``, or called inside
    ``torch._dynamo.compiled_autograd._enable``: it needs that reducer), and anything that is not
    DDP; the message says what works (``optimize_ddp="ddp_optimizer"``, the default, without compiled autograd).
    """
    from torch.nn.parallel import DistributedDataParallel

    if _is_fsdp(model):
        raise TypeError(
            f"PowerSGD DDP hooks do not support FSDP ({type(model).__name__}): they compress DistributedDataParallel "
            "buckets; FSDP reduce-scatters sharded gradients. Use DistributedDataParallel, or for HSDP with FSDP2 "
            "(fully_shard on a 1-D shard mesh) powersgd_triton.fsdp.hsdp.register_fsdp, which compresses the replicate "
            "all-reduce"
        )
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"expected a torch.nn.parallel.DistributedDataParallel model, got {type(model).__name__}; wrap the model "
            "in DistributedDataParallel first (a single-process run has nothing to compress)"
        )
    from powersgd_triton.hooks.driver import COMPILED_AUTOGRAD_WAY_OUT

    if getattr(model, "_use_python_reducer", False):
        raise TypeError(
            "this DistributedDataParallel model uses compiled DDP's python reducer "
            "(torch._dynamo.config.optimize_ddp='python_reducer'), which calls comm hooks once per parameter with a "
            "(grad, param) tuple. " + COMPILED_AUTOGRAD_WAY_OUT
        )
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and getattr(dynamo.config, "compiled_autograd", False):
        raise TypeError(
            "torch._dynamo.config.compiled_autograd is on: DDP's C++ reducer then refuses the backward and asks for "
            "the python reducer, which calls comm hooks per parameter. " + COMPILED_AUTOGRAD_WAY_OUT
        )
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled_autograd is not None and getattr(compiled_autograd, "compiled_autograd_enabled", False):
        raise TypeError(
            "compiled autograd is enabled here (torch._dynamo.compiled_autograd._enable): DDP's C++ reducer then "
            "refuses the backward and asks for the python reducer, which calls comm hooks per parameter. "
            + COMPILED_AUTOGRAD_WAY_OUT
        )


def adopt_grad_scaler(state, scaler) -> bool:
    """Give ``state`` (a :class:`powersgd_triton.PowerSGDState`) the framework's loss scaler, so that its error
    memory is kept in unscaled units (``PowerSGDState(grad_scaler=...)``); used by the Lightning and Accelerate
    integrations when they run AMP with fp16 (a ``torch.amp.GradScaler``). Nothing happens when ``scaler`` is not an
    enabled GradScaler, or ``state`` is not ours; a scaler the user gave the state is kept (a different one is
    named in a warning). Returns True when the state uses ``scaler`` afterwards."""
    import warnings

    import torch

    from powersgd_triton.state.powersgd_state import PowerSGDState

    if not isinstance(state, PowerSGDState) or not isinstance(scaler, torch.amp.GradScaler):
        return False
    if not scaler.is_enabled():
        return False
    if state.grad_scaler is None:
        state.grad_scaler = scaler
        return True
    if state.grad_scaler is not scaler:
        warnings.warn(
            "PowerSGD: the PowerSGDState has a grad_scaler that is not the one the training loop scales the loss "
            "with; the error memory is unscaled with the state's: keeping it",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def register(model, state, hook=None):
    """Register ``hook`` (default :func:`powersgd_triton.powerSGD_hook`) with ``state`` on the DDP ``model``.

    Same as ``model.register_comm_hook(state, hook)`` (wrapped hooks such as
    ``bf16_compress_wrapper(powerSGD_hook)`` are fine), plus :func:`check_ddp_model` and, for a
    :class:`powersgd_triton.PowerSGDState`, the parameter names used by its checkpoints. Returns ``model``.

    Raises:
        TypeError: FSDP, compiled DDP's python reducer, compiled autograd (on in ``torch._dynamo.config`` or entered
            with ``torch._dynamo.compiled_autograd._enable``), not a DDP model, or a state that is not ours with our
            hook.
        ValueError: our state's process group (None: WORLD) holds other ranks than the one DDP all-reduces in.
    """
    from powersgd_triton import variants
    from powersgd_triton.hooks import driver as _step
    from powersgd_triton.hooks import layerwise as _hooks
    from powersgd_triton.state.powersgd_state import PowerSGDState

    if hook is None:
        hook = _hooks.powerSGD_hook
    check_ddp_model(model)
    ours = variants.functions()
    if hook in ours:
        _step.check_state(state, hook.__name__)
    if isinstance(state, PowerSGDState):
        if hook in ours:
            from powersgd_triton.state.models import check_group

            group = _step.process_group(state)
            check_group(state, model, group)  # DDP's group: a mismatch refused now
            state.buckets.group_checked = group  # the first hook call need not look for the DDP again (a gc scan)
        _step.bind_model(state, model)
    model.register_comm_hook(state, hook)
    return model
