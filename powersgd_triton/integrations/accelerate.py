"""Hugging Face Accelerate: register our PowerSGD hook on the model ``accelerator.prepare`` returned.

Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` is a closed list of PyTorch's hooks (it builds
PyTorch's ``PowerSGDState`` itself, and refuses subclasses of the kwargs handler), so the route for our hook is to
leave ``comm_hook`` unset and register on the prepared model. :func:`register_comm_hook` does that in one call, in
``MULTI_GPU`` and ``MULTI_CPU`` (gloo) modes alike, with the checks of
:func:`powersgd_triton.integrations.register`; and it makes ``accelerator.save_state(dir)`` /
``accelerator.load_state(dir)`` carry every rank's hook state (``dir/hook_state.rank{r}.pt``; Accelerate's own
``register_for_checkpointing`` would write rank 0's only). Example::

    from accelerate import Accelerator
    from powersgd_triton import PowerSGDState, powerSGD_hook
    from powersgd_triton.integrations.accelerate import register_comm_hook

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
    register_comm_hook(accelerator, model, state, powerSGD_hook)

This module imports ``accelerate`` only inside the functions that need it.
"""

import logging

__all__ = ["register_comm_hook"]

log = logging.getLogger(__name__)

# Accelerate modes whose model is not a torch DistributedDataParallel; the hook has nothing to attach to there.
_UNSUPPORTED = {
    "FSDP": "FSDP reduce-scatters sharded gradients",
    "DEEPSPEED": "DeepSpeed runs its own gradient reduction",
    "MEGATRON_LM": "Megatron-LM runs its own gradient reduction",
    "XLA": "XLA does not use DDP comm hooks",
}


def _unwrap(model):
    """The DDP inside ``torch.compile``'s wrapper (Accelerate compiles after wrapping when dynamo is on)."""
    return getattr(model, "_orig_mod", model)


def register_comm_hook(accelerator, model, state, hook=None, *, checkpoint: bool = True) -> bool:
    """Register ``hook`` (default :func:`powersgd_triton.powerSGD_hook`) with ``state`` on the prepared ``model``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: what ``accelerator.prepare`` returned for the model.
        state: a :class:`powersgd_triton.PowerSGDState` (``process_group=None``: the world group).
        hook: :func:`~powersgd_triton.powerSGD_hook` (default), another of
            :data:`~powersgd_triton.variants.VARIANTS`, or a wrapped one
            (``powersgd_triton.hooks.wrappers.bf16_compress_wrapper(powerSGD_hook)``).
        checkpoint: also save/load every rank's hook state with ``accelerator.save_state`` / ``load_state``.

    With ``mixed_precision="fp16"`` the accelerator's ``GradScaler`` becomes ``state.grad_scaler`` (unless the state
    has one already): the error memory is kept in unscaled units (see :class:`~powersgd_triton.PowerSGDState`).
    Accelerate saves the scaler itself in ``save_state``.

    Returns:
        True when the hook was registered; False for a single-process run (``prepare`` does not wrap the model in
        DDP then, and there is nothing to communicate).

    Raises:
        TypeError: Accelerate runs FSDP, DeepSpeed, Megatron-LM or XLA, or the model is not DDP in a multi-process
            run (see :func:`powersgd_triton.integrations.check_ddp_model`).
    """
    from powersgd_triton.integrations import adopt_grad_scaler, register

    mode = getattr(getattr(accelerator, "distributed_type", None), "name", str(accelerator.distributed_type))
    if mode in _UNSUPPORTED:
        raise TypeError(
            f"PowerSGD comm hooks need DistributedDataParallel; this Accelerator runs {mode} "
            f"({_UNSUPPORTED[mode]}). Use MULTI_GPU or MULTI_CPU (plain DDP)"
        )
    ddp = _unwrap(model)
    if accelerator.num_processes == 1:
        log.info("PowerSGD: single process, nothing to communicate: no comm hook registered")
        return False
    register(ddp, state, hook)
    # AMP with fp16 (mixed_precision="fp16"): the accelerator's GradScaler keeps the error memory unscaled
    adopt_grad_scaler(state, getattr(accelerator, "scaler", None))
    if checkpoint:
        _checkpoint_with_accelerator(accelerator, ddp, state)
    return True


def _checkpoint_with_accelerator(accelerator, ddp, state) -> None:
    from powersgd_triton.checkpoint import load_hook_state_if_saved, save_hook_state

    rank, world_size = accelerator.process_index, accelerator.num_processes

    def save_pre_hook(models, weights, output_dir):  # called on every process by save_state
        save_hook_state(state, ddp, output_dir, rank=rank, world_size=world_size)

    def load_pre_hook(models, input_dir):  # called on every process by load_state
        load_hook_state_if_saved(state, ddp, input_dir, rank=rank, world_size=world_size)

    accelerator.register_save_state_pre_hook(save_pre_hook)
    accelerator.register_load_state_pre_hook(load_pre_hook)
