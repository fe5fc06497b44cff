"""What the multi-rank resume tests share: the per-rank training steps and the report of a resumed run.

A resume test trains an uninterrupted reference, then stops, saves, rebuilds, loads and continues;
:func:`continue_and_report` runs the continuation and says how it compares with the reference parameters.
"""

import warnings
from typing import Dict, List

import torch


def train_steps(ddp, opt, rank: int, start: int, stop: int) -> None:
    """Steps ``start .. stop - 1`` of SGD on ``sum(ddp(x)**2)``, ``x`` an (8, 20) batch seeded by step and rank (each
    rank its own data, so the per-rank error memories differ)."""
    for i in range(start, stop):
        x = torch.randn(8, 20, generator=torch.Generator().manual_seed(1000 * i + rank))
        opt.zero_grad()
        ddp(x).pow(2).sum().backward()
        opt.step()


def continue_and_report(ddp, opt, state, rank: int, start: int, stop: int,
                        reference: List[torch.Tensor]) -> Dict:
    """Run steps ``start .. stop - 1`` of the resumed job, recording warnings; then ``equal`` (every parameter
    bitwise equal to ``reference``, the uninterrupted run's), ``max_diff`` (largest absolute difference),
    ``warnings`` (the PowerSGD ones raised meanwhile) and ``iter`` (the state's iteration counter)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_steps(ddp, opt, rank, start, stop)
    got = [p.detach() for p in ddp.parameters()]
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(reference, got)),
        "max_diff": max(float((a - b).abs().max()) for a, b in zip(reference, got)),
        "warnings": [str(w.message) for w in caught if "PowerSGD" in str(w.message)],
        "iter": state.iter,
    }
