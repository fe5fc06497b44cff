"""Block-size selection for the Triton kernels, per GPU model (work in progress: heuristic only for now).

``configs_for_layout(layout, dtype, device, process_group=None)`` returns ``{kernel name: config dict}`` for the four
bucket kernels, to be passed as ``config=`` to :mod:`powersgd_triton.ops`. On the torch backend it returns ``{}``.
"""

from typing import Dict, Optional

import torch

from .. import _env
from ..layout import BucketLayout

KERNELS = ("project", "orthogonalize", "project_t", "reconstruct")


def configs_for_layout(
    layout: BucketLayout, dtype: torch.dtype, device: torch.device, process_group=None
) -> Dict[str, Optional[dict]]:
    """Config per kernel for this bucket layout (heuristic; the tuned lookup replaces this)."""
    if not _env.triton_can_run(torch.device(device)):
        return {}
    from ..kernels import triton_ops

    return {k: triton_ops.heuristic_config(k, layout, dtype) for k in KERNELS}
