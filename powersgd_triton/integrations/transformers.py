"""Hugging Face Transformers: ``PowerSGDCallback``, a ``TrainerCallback`` that registers a PowerSGD hook on the
``DistributedDataParallel`` model a ``transformers.Trainer`` trains.

``Trainer`` has no comm-hook option: it wraps the model in DDP (through Accelerate's ``prepare``) inside ``train()``,
after the callbacks were made, and calls ``on_train_begin`` right after that, before the first backward pass. The
callback registers the hook there, on every rank, with
:func:`powersgd_triton.integrations.accelerate.register_comm_hook` on the Trainer's accelerator and
``trainer.model_wrapped`` (the DDP). That call refuses FSDP, DeepSpeed and the other modes without DDP, compiled DDP's
python reducer and compiled autograd; it checks the state's process group and names the parameters for checkpoints;
with ``fp16=True`` it gives the state Accelerate's ``GradScaler``. Example::

    from transformers import Trainer, TrainingArguments
    from powersgd_triton import PowerSGDState, powerSGD_hook
    from powersgd_triton.integrations.transformers import PowerSGDCallback

    state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=1000)
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=dataset,
                      callbacks=[PowerSGDCallback(state, powerSGD_hook)])
    trainer.train()  # torchrun --nproc-per-node N train.py (or accelerate launch)

The callback's events get the unwrapped model, the optimizer and the data loaders as keyword arguments, but neither the
DDP around the model nor the Trainer nor its accelerator (transformers 5.x, ``CallbackHandler.call_event``). The Trainer
calls its callbacks synchronously from its own methods, so the callback takes the Trainer from its caller's frames: the
nearest ``Trainer`` on the call stack whose callback list holds this callback. This module imports ``transformers``
when it is imported itself (``import powersgd_triton`` does not import it).

Source: transformers' ``Trainer._inner_training_loop`` (``_prepare_for_training`` wraps the model, then
``on_train_begin``); PyTorch's ``DistributedDataParallel.register_comm_hook``.
"""

import logging
import sys
import weakref

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised where transformers is absent
    raise ImportError(
        "powersgd_triton.integrations.transformers needs Hugging Face Transformers: "
        'pip install "powersgd_triton[transformers]" (or pip install transformers accelerate)'
    ) from exc

__all__ = ["PowerSGDCallback"]

log = logging.getLogger(__name__)


class PowerSGDCallback(TrainerCallback):
    """Register ``hook`` with ``state`` on the DDP model of the ``transformers.Trainer`` this callback is given to.

    Args:
        state: a :class:`powersgd_triton.PowerSGDState` (``process_group=None``: the world group); PyTorch's own
            ``PowerSGDState`` with PyTorch's hook works too.
        hook: :func:`~powersgd_triton.powerSGD_hook` (default), another of our hooks
            (:data:`powersgd_triton.variants.VARIANTS`), a wrapped one
            (``powersgd_triton.hooks.wrappers.bf16_compress_wrapper(powerSGD_hook)``) or PyTorch's.

    At ``on_train_begin`` (every rank, after the Trainer wrapped the model in DDP, before the first backward pass) the
    hook is registered on ``trainer.model_wrapped``; a second ``train()`` on the same DDP keeps the hook it has (DDP
    takes one comm hook). A single-process run registers nothing: there is nothing to communicate. Gradient
    accumulation works as with any DDP hook: the hook runs on the steps that synchronize, and ``state.iter`` counts
    those. The Trainer's checkpoints do not carry the hook state: a run resumed with
    ``train(resume_from_checkpoint=...)`` starts PowerSGD afresh (``state.iter`` from 0: ``start_powerSGD_iter``
    steps of plain all-reduce, then new error memory and warm-start Q).

    Raises (from ``trainer.train()``, at its start):
        TypeError: the Trainer runs FSDP, DeepSpeed or another mode without DDP, or compiled DDP's python reducer /
            compiled autograd (see :func:`powersgd_triton.integrations.check_ddp_model`); a state that is not ours
            with our hook.
        ValueError: our state's process group holds other ranks than the one DDP all-reduces in.
        RuntimeError: no ``Trainer`` that holds this callback is calling it (its events were called by other code).
    """

    def __init__(self, state, hook=None):
        self.state = state
        self.hook = hook
        self._registered_on = None  # weakref to the DDP the hook was registered on

    def _calling_trainer(self) -> "Trainer":
        """The nearest ``Trainer`` on the call stack whose callback list holds this callback."""
        frame = sys._getframe(1)
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer):
                handler = getattr(obj, "callback_handler", None)
                if any(c is self for c in getattr(handler, "callbacks", ())):
                    return obj
            frame = frame.f_back
        raise RuntimeError(
            "PowerSGDCallback: no transformers.Trainer holding this callback is calling it; pass it to "
            "Trainer(callbacks=[...]) or trainer.add_callback(...) and let trainer.train() call it"
        )

    def on_train_begin(self, args, state, control, **kwargs):
        """Register the hook on the Trainer's DDP (see the class docstring for what is raised)."""
        trainer = self._calling_trainer()
        from powersgd_triton.integrations.accelerate import _unwrap, register_comm_hook

        ddp = _unwrap(trainer.model_wrapped)
        if self._registered_on is not None and self._registered_on() is ddp:
            return  # a second train() on the same DDP: the hook is in place
        if register_comm_hook(trainer.accelerator, trainer.model_wrapped, self.state, self.hook, checkpoint=False):
            self._registered_on = weakref.ref(ddp)
