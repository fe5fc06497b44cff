"""What ``bench --link`` trains: the train command's workloads, and a CIFAR-shaped ResNet-18 on generated data.

:func:`make` returns a :class:`Workload`: a model built from a seed, the batch of a step for a rank, the loss and
the optimizer. For ``digits``, ``mnist5k`` and ``charlm`` these are the train command's own
(:mod:`powersgd_triton.train`: its data, model, batches, loss and optimizer settings, at a constant learning rate).
``resnet18`` is ResNet-18 for 32 x 32 images (He et al. 2016, with the CIFAR stem of its section 4.2 in the form
common in CIFAR code: a 3 x 3 stem convolution and no max-pool; 11.17 M parameters, 44.7 MB of float32 gradients)
on images drawn from a seeded normal distribution with random labels: the shapes and compute of CIFAR-10 training,
no download.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

RESNET18 = "resnet18"
RESNET18_DEFAULTS = dict(batch_size=16, lr=0.1, momentum=0.9, weight_decay=5e-4)
_POOL = 1024  # generated images per rank pool; batches cycle through it


class BasicBlock(nn.Module):
    """Two 3 x 3 convolutions with batch norm and an identity (or 1 x 1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18Cifar(nn.Module):
    """``forward(x (B, 3, 32, 32) float32) -> logits (B, num_classes)``: stem 3 -> 64, four stages of two blocks
    (64, 128, 256, 512 channels; stride 2 from the second), global average pool, linear."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            for j in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


@dataclass
class Workload:
    """One workload as the bench runs it. ``model()``: a fresh model (the caller seeds torch first);
    ``batch(step, rank, world_size)``: that rank's ``(x, y)`` of that step, the same for every hook;
    ``loss(model, x, y)``: a float32 scalar; ``optimizer(params)``; ``clip``: gradient-norm clipping or None."""

    name: str
    batch_size: int
    model: Callable[[], nn.Module]
    batch: Callable[[int, int, int], Tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    clip: Optional[float] = None


def _train_workload(name: str, batch_size: Optional[int], seed: int, world_size: int, steps: int) -> Workload:
    from powersgd_triton.train import data as data_mod
    from powersgd_triton.train.loop import TrainConfig, batch_loss, rank_batch, training_plan
    from powersgd_triton.train.models import build_model

    cfg = TrainConfig(workload=name, batch_size=batch_size, world_size=world_size, seed=seed, steps=steps).resolved()
    data = data_mod.load_workload(name, seed)
    n_items, per_epoch, _ = training_plan(cfg, data)
    perms: Dict[int, torch.Tensor] = {}

    def batch(step: int, rank: int, world: int):
        epoch, i = divmod(step, per_epoch)
        if epoch not in perms:
            perms.clear()
            perms[epoch] = data_mod.epoch_permutation(n_items, seed, epoch)
        return rank_batch(cfg, data, perms[epoch], i, epoch, rank, torch.device("cpu"))

    def optimizer(params):
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    return Workload(name, cfg.batch_size, lambda: build_model(name, data), batch,
                    lambda model, x, y: batch_loss(cfg, model, x, y), optimizer, cfg.clip)


def _resnet18(batch_size: Optional[int], seed: int, rank: int) -> Workload:
    bs = batch_size or RESNET18_DEFAULTS["batch_size"]
    g = torch.Generator().manual_seed(seed * 1009 + rank)  # each rank its own images, as a DistributedSampler
    images = torch.randn(_POOL, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (_POOL,), generator=g)

    def batch(step: int, rank_: int, world: int):
        idx = (torch.arange(bs) + step * bs) % _POOL
        return images[idx], labels[idx]

    def optimizer(params):
        d = RESNET18_DEFAULTS
        return torch.optim.SGD(params, lr=d["lr"], momentum=d["momentum"], weight_decay=d["weight_decay"])

    return Workload(RESNET18, bs, ResNet18Cifar, batch, lambda model, x, y: F.cross_entropy(model(x), y), optimizer)


def make(name: str, *, batch_size: Optional[int], seed: int, rank: int, world_size: int, steps: int) -> Workload:
    """The workload ``name`` (a train workload or ``resnet18``) for ``rank`` of ``world_size``, for ``steps`` steps.
    Raises ``ValueError`` for an unknown name or a batch larger than the data set,
    :class:`~powersgd_triton.train.data.DataUnavailable` when its data package is missing."""
    if name == RESNET18:
        return _resnet18(batch_size, seed, rank)
    return _train_workload(name, batch_size, seed, world_size, steps)
