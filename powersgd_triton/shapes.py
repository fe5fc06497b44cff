"""Gradient shape sets of real models, and DDP-like bucketing, for benchmarks, the autotuner and tests.

The parameter shapes are generated here from the published architectures (no download, no torchvision or
transformers needed), in ``model.parameters()`` order:

* ``resnet50``: He et al. 2016, torchvision's definition (conv + batch-norm weights/biases + fc): 161 tensors.
* ``bert-base``: Devlin et al. 2019, HF ``BertModel`` (bert-base-uncased, vocab 30522) with pooler: 199 tensors.
* ``gpt2``: Radford et al. 2019, GPT-2 small (HF ``GPT2Model``; ``Conv1D`` weights are ``(in, out)``): 148 tensors.
* ``vit-b16``: Dosovitskiy et al. 2021, torchvision ``vit_b_16``: 152 tensors.

:func:`ddp_buckets` splits them like DDP does: parameters in reverse order, a bucket closes when it reaches
``bucket_cap_mb`` (DDP's default 25 MB; DDP's separate 1 MB first bucket is left out unless asked for).
"""

from typing import Dict, List, Sequence, Tuple

Shape = Tuple[int, ...]


def _resnet50() -> List[Shape]:
    shapes: List[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = width * 4
            shapes += [(width, in_ch, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, in_ch, 1, 1), (out,), (out,)]
            in_ch = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def _bert_base() -> List[Shape]:
    h, ff = 768, 3072
    shapes: List[Shape] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        for _ in range(3):  # query, key, value
            shapes += [(h, h), (h,)]
        shapes += [(h, h), (h,), (h,), (h,)]  # attention output dense + LayerNorm
        shapes += [(ff, h), (ff,), (h, ff), (h,), (h,), (h,)]  # intermediate, output dense, LayerNorm
    shapes += [(h, h), (h,)]  # pooler
    return shapes


def _gpt2() -> List[Shape]:
    h = 768
    shapes: List[Shape] = [(50257, h), (1024, h)]
    for _ in range(12):
        shapes += [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,)]
        shapes += [(h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    shapes += [(h,), (h,)]
    return shapes


def _vit_b16() -> List[Shape]:
    h, ff = 768, 3072
    shapes: List[Shape] = [(1, 1, h), (h, 3, 16, 16), (h,), (1, 197, h)]
    for _ in range(12):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (ff, h), (ff,), (h, ff), (h,)]
    shapes += [(h,), (h,), (1000, h), (1000,)]
    return shapes


MODELS = {"resnet50": _resnet50, "bert-base": _bert_base, "gpt2": _gpt2, "vit-b16": _vit_b16}


def model_shapes(name: str) -> List[Shape]:
    """Parameter (= gradient) shapes of ``name`` in ``parameters()`` order. Raises ``ValueError`` if unknown."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}") from None


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def ddp_buckets(
    shapes: Sequence[Shape], bucket_cap_mb: float = 25.0, element_size: int = 4, first_bucket_mb: float = 0.0
) -> List[List[Shape]]:
    """Group ``shapes`` into DDP-like buckets: reverse parameter order, close a bucket once it holds
    ``bucket_cap_mb`` MiB (``element_size`` bytes per element). ``first_bucket_mb > 0`` mimics DDP's smaller first
    bucket. Each bucket lists its shapes in bucket order (the gradients' order in the flat buffer)."""
    buckets: List[List[Shape]] = []
    current: List[Shape] = []
    size = 0
    cap = (first_bucket_mb if first_bucket_mb > 0 else bucket_cap_mb) * 2**20
    for shape in reversed(list(shapes)):
        current.append(tuple(shape))
        size += numel(shape) * element_size
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
            cap = bucket_cap_mb * 2**20
    if current:
        buckets.append(current)
    return buckets


def shape_summary(name: str) -> Dict[str, int]:
    """Counts for docs and tests: tensors, matrices (dim >= 2), elements."""
    s = model_shapes(name)
    return {"tensors": len(s), "matrices": sum(len(x) >= 2 for x in s), "numel": sum(numel(x) for x in s)}
