"""PyTorch Lightning: ``PowerSGDDDPStrategy``, a ``DDPStrategy`` that registers the comm hook on CPU and GPU alike.

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=..., ddp_comm_wrapper=...)`` registers the hook only when
the root device is CUDA: on CPU (gloo) it silently trains without it. ``PowerSGDDDPStrategy`` takes the same arguments
and registers the hook on any device, through :func:`powersgd_triton.integrations.register` (which refuses FSDP and
compiled DDP's python reducer, and names the parameters for checkpoints). On GPU it behaves as ``DDPStrategy``.

It also makes checkpoints carry the hook state of every rank (the error-feedback memory is each rank's own, and
Lightning writes its checkpoint on rank 0 only): when Lightning saves ``path.ckpt``, every rank writes
``path.ckpt.hook_state.rank{r}.pt`` (:func:`powersgd_triton.checkpoint.save_hook_state`); ``Trainer.fit(ckpt_path=...)``
loads them back on every rank with the checks of :func:`powersgd_triton.checkpoint.load_hook_state`; removing a
checkpoint (``ModelCheckpoint(save_top_k=...)``) removes them too. Pass ``save_hook_state=False`` to turn that off.

Works with ``pytorch_lightning`` and with ``lightning.pytorch`` (the ``lightning`` package): ``PowerSGDDDPStrategy``
subclasses the ``DDPStrategy`` of the one already imported when this module is imported (``lightning.pytorch`` first
when both or neither are); :func:`strategy_class` picks explicitly. Example::

    import pytorch_lightning as pl
    from powersgd_triton import PowerSGDState, powerSGD_hook
    from powersgd_triton.integrations.lightning import PowerSGDDDPStrategy

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=5000)
    strategy = PowerSGDDDPStrategy(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)
"""

import importlib
import logging
import os
import sys
from typing import Dict

__all__ = ["PowerSGDDDPStrategy", "strategy_class", "hook_state_pattern"]

log = logging.getLogger(__name__)
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_CLASSES: Dict[str, type] = {}


def hook_state_pattern(checkpoint_path) -> str:
    """Where the per-rank hook state of a Lightning checkpoint goes: ``<checkpoint_path>.hook_state.rank{rank}.pt``."""
    return os.fspath(checkpoint_path) + ".hook_state.rank{rank}.pt"


def _default_package() -> str:
    for name in _PACKAGES:
        if name in sys.modules:
            return name
    for name in _PACKAGES:
        try:
            importlib.import_module(name)
            return name
        except ImportError:
            continue
    raise ImportError(
        "powersgd_triton.integrations.lightning needs PyTorch Lightning: pip install pytorch-lightning (or lightning)"
    )


def strategy_class(package: str = None) -> type:
    """``PowerSGDDDPStrategy`` for ``package`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``; default: see the
    module docstring). Classes are made once per package."""
    package = package or _default_package()
    if package == "lightning":
        package = "lightning.pytorch"
    if package not in _PACKAGES:
        raise ValueError(f"package must be one of {_PACKAGES}, got {package!r}")
    if package not in _CLASSES:
        _CLASSES[package] = _make_class(package)
    return _CLASSES[package]


def _make_class(package: str) -> type:
    strategies = importlib.import_module(package + ".strategies")
    overrides = importlib.import_module(package + ".overrides.distributed")
    DDPStrategy = strategies.DDPStrategy
    register_with_lightning = overrides._register_ddp_comm_hook

    class PowerSGDDDPStrategy(DDPStrategy):
        """``DDPStrategy`` whose comm hook is registered on every device type, with per-rank hook-state checkpoints.

        Arguments: those of ``DDPStrategy``, plus ``save_hook_state`` (default True): write/read/remove
        ``<checkpoint>.hook_state.rank{r}.pt`` with each Lightning checkpoint. With ``precision="16-mixed"``, the
        precision plugin's ``GradScaler`` becomes the state's ``grad_scaler`` (error memory in unscaled units;
        Lightning checkpoints the scaler itself).
        """

        def __init__(self, *args, save_hook_state: bool = True, **kwargs):
            super().__init__(*args, **kwargs)
            self._powersgd_save_hook_state = bool(save_hook_state)

        # -- registration -------------------------------------------------------------------------------------
        def _register_ddp_hooks(self) -> None:
            if self._ddp_comm_hook is None:
                return
            from powersgd_triton.state.buckets import bind_model
            from powersgd_triton.state.powersgd_state import PowerSGDState
            from powersgd_triton.integrations import check_ddp_model

            check_ddp_model(self.model)
            state = self._ddp_comm_state
            if isinstance(state, PowerSGDState):
                bind_model(state, self.model)
                # precision="16-mixed": Lightning's GradScaler keeps the error memory in unscaled units
                from powersgd_triton.integrations import adopt_grad_scaler

                adopt_grad_scaler(state, getattr(self.precision_plugin, "scaler", None))
            register_with_lightning(
                model=self.model,
                ddp_comm_state=state,
                ddp_comm_hook=self._ddp_comm_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )

        # -- per-rank hook state in checkpoints ------------------------------------------------------------------
        def _hook_state(self):
            from powersgd_triton.state.powersgd_state import PowerSGDState

            state = self._ddp_comm_state
            if self._powersgd_save_hook_state and isinstance(state, PowerSGDState) and self._ddp_comm_hook:
                return state
            return None

        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            state = self._hook_state()
            if state is not None:
                from powersgd_triton.checkpoint import save_hook_state

                save_hook_state(state, self.lightning_module, hook_state_pattern(filepath),
                                rank=self.global_rank, world_size=self.world_size)

        def load_checkpoint(self, checkpoint_path, *args, **kwargs):
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
            state = self._hook_state()
            if state is not None:
                from powersgd_triton.checkpoint import load_hook_state_if_saved

                load_hook_state_if_saved(state, self.lightning_module, hook_state_pattern(checkpoint_path),
                                         rank=self.global_rank, world_size=self.world_size,
                                         checkpoint=str(checkpoint_path))
            return checkpoint

        def remove_checkpoint(self, filepath) -> None:
            super().remove_checkpoint(filepath)
            if self._hook_state() is not None:
                from powersgd_triton.checkpoint import hook_state_path

                file = hook_state_path(hook_state_pattern(filepath), self.global_rank)
                if os.path.exists(file):
                    os.remove(file)

    # A unique module-level name per package, so that instances pickle (Lightning's spawn launcher pickles them).
    name = "PowerSGDDDPStrategy_" + package.replace(".", "_")
    PowerSGDDDPStrategy.__module__ = __name__
    PowerSGDDDPStrategy.__name__ = PowerSGDDDPStrategy.__qualname__ = name
    globals()[name] = PowerSGDDDPStrategy
    return PowerSGDDDPStrategy


#: ``PowerSGDDDPStrategy`` of the default Lightning package (see the module docstring).
PowerSGDDDPStrategy = strategy_class()
