"""The hooks' state: :class:`PowerSGDState` (:mod:`.powersgd_state`) and what it holds.

* :mod:`.memory` - a bucket's memory: error memory, P and Q (warm start), work buffers, its backend;
* :mod:`.buckets` - the memory of every bucket: rebuild migration, resume by parameter names, one model/one group;
* :mod:`.state_dict` - ``state_dict()`` / ``load_state_dict()``; :mod:`.predraw` - the first Qs drawn at save;
  :mod:`.rebuild` - the buckets DDP rebuilds after its first iteration, told before (a save at iteration 1);
* :mod:`.torch_interop` - PyTorch's hook and PyTorch's pickles on our state (``error_dict`` & co.);
* :mod:`.models` - which DDP model and process group a state serves.
"""

from powersgd_triton.state.powersgd_state import PowerSGDState, check_grad_scaler

# the public import path, as pickles and messages name the class (as before the re-seat)
PowerSGDState.__module__ = __name__

__all__ = ["PowerSGDState", "check_grad_scaler"]
