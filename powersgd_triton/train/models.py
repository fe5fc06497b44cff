"""Small models for the three workloads; every one has weight matrices the PowerSGD hook compresses.

* ``DigitsConvNet`` (digits, 1×8×8): conv 1→32 3×3, conv 32→64 3×3, max-pool, linear 1024→128→10. The second conv
  (viewed by the hook as 64×288) and the linear layers are compressed at rank 4; the first conv (32×9) and the
  biases are too small to gain and are all-reduced as they are.
* ``MnistMLP`` (mnist5k, 784 inputs): linear 784→512→512→10, the paper-like case where compression matters.
* ``CharLSTM`` (charlm): embedding → 2-layer LSTM → linear over the character vocabulary.
"""

import torch
from torch import nn


class DigitsConvNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MnistMLP(nn.Module):
    def __init__(self, num_classes: int = 10, hidden: int = 512):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharLSTM(nn.Module):
    """Character LM: ``forward(ids (B, T)) -> logits (B, T, vocab)``."""

    def __init__(self, vocab_size: int, embed: int = 64, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def build_model(workload: str, data=None, **kwargs) -> nn.Module:
    """The model of ``workload`` (``data`` gives the vocabulary size for charlm)."""
    if workload == "digits":
        return DigitsConvNet(**kwargs)
    if workload == "mnist5k":
        return MnistMLP(**kwargs)
    if workload == "charlm":
        if data is None:
            raise ValueError("charlm needs its data to size the vocabulary")
        return CharLSTM(data.vocab_size, **kwargs)
    raise ValueError(f"unknown workload {workload!r}")
