"""``powersgd-triton bench --link RATES``: step time of a real 2-rank DDP training run over a bandwidth-limited link.

Does PowerSGD pay on my link? For each link rate the bench trains a workload of the train command (or a CIFAR-shaped
ResNet-18 on generated data) with plain all-reduce, PyTorch's ``powerSGD_hook`` and ours, interleaved step by step
from the same seed, and reports the median step time over the compressed steps, its spread, the bytes all-reduced
per step and the ratio to all-reduce measured in the same run.

* :mod:`.rates` (no torch): the ``--link`` rates and the ``tc tbf`` arguments.
* :mod:`.names` (no torch): hook and workload names, defaults, :class:`~.names.Spec` (what a launch measures).
* :mod:`.options` (no torch): the options ``--link`` adds to the bench parser.
* :mod:`.netns`: two network namespaces joined by a veth pair with a ``tc tbf`` limit on each end (``--netns``),
  always removed again.
* :mod:`.workloads`: the models, batches, losses and optimizers (the train command's, and ResNet-18).
* :mod:`.ranks`: what one rank runs (``python -m powersgd_triton.linkbench.ranks SPEC OUT``).
* :mod:`.run`: the command: the checks, one pair of ranks per rate and workload, the rows.
* :mod:`.report` (no torch): the rows' statistics, the JSON (``--out``), the table and the chart (``--plot``).

See ``docs/when-it-pays.md`` for what the measurements say.
"""
