"""ResNet-50's parameter shapes (torchvision's ``resnet50()`` order, 161 tensors, 25.56 M values) and DDP's buckets.

Written out here so that the hook tests and reports do not need torchvision.
"""

from typing import List, Tuple

import torch
import torch.distributed as dist

Shape = Tuple[int, ...]


def resnet50_shapes(num_classes: int = 1000) -> List[Shape]:
    shapes: List[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
            shapes += [(planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(num_classes, 2048), (num_classes,)]
    return shapes


def ddp_buckets(shapes: List[Shape], bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0, dtype=torch.float32):
    """Gradient shapes per bucket, in DDP's order after its rebuild (gradients arrive in reverse definition order).

    Uses DDP's own assignment (``dist._compute_bucket_assignment_by_size``) with its default caps.
    """
    params = [torch.empty(s, dtype=dtype, device="meta") for s in reversed(shapes)]
    mb = 1024 * 1024
    indices, _ = dist._compute_bucket_assignment_by_size(
        params, [int(first_bucket_mb * mb), int(bucket_cap_mb * mb)], [False] * len(params)
    )
    return [[tuple(params[i].shape) for i in bucket] for bucket in indices]
