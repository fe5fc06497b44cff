"""Fake DDP buckets: :class:`FakeGradBucket` (a ``GradBucket`` stand-in over one flat buffer whose gradients are
views) and the random-filled buckets of a real model's gradient shapes (:func:`model_buckets`, from
:mod:`powersgd_triton.shapes`; never zeros: zeros hide unwritten outputs and can run faster than real data).
"""

from typing import List, Optional, Sequence

import torch

from powersgd_triton.layout import BucketLayout
from powersgd_triton.shapes import Shape, ddp_buckets, model_shapes, numel


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DDP_FIRST_BUCKET_MB = 1.0  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, also used after DDP rebuilds its buckets


class FakeGradBucket:
    """A ``GradBucket`` stand-in: one flat 1-D buffer, the gradients are row-major views into it, back to back.

    Args:
        buffer: flat 1-D tensor holding every gradient.
        shapes: gradient shapes, in buffer order.
        index: bucket index (DDP: bucket 0 holds the last layers, its gradients are ready first).
        num_buckets: number of buckets of the model; ``is_last()`` is ``index == num_buckets - 1`` like DDP's.
        parameters: optional parameter tensors; by default ``meta`` parameters of the gradients' shapes (no memory).
    Raises:
        ValueError: the shapes do not fill the buffer exactly, or the buffer is not 1-D.
    """

    def __init__(self, buffer: torch.Tensor, shapes: Sequence[Shape], index: int = 0, num_buckets: int = 1,
                 parameters: Optional[List[torch.Tensor]] = None):
        self._shapes = [tuple(int(d) for d in s) for s in shapes]
        self._index = int(index)
        self._num_buckets = int(num_buckets)
        if not 0 <= self._index < self._num_buckets:
            raise ValueError(f"bucket index {index} outside 0..{num_buckets - 1}")
        self._parameters = parameters
        self._set(buffer)

    def _set(self, buffer: torch.Tensor) -> None:
        if buffer.dim() != 1:
            raise ValueError(f"bucket buffer must be 1-D, got {tuple(buffer.shape)}")
        total = sum(numel(s) for s in self._shapes)
        if total != buffer.numel():
            raise ValueError(f"shapes hold {total} elements, the buffer {buffer.numel()}")
        views, off = [], 0
        for s in self._shapes:
            views.append(buffer[off : off + numel(s)].view(s))
            off += numel(s)
        self._buffer = buffer
        self._gradients = views

    # -- the GradBucket API
    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        return list(self._gradients)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._num_buckets - 1

    def parameters(self) -> List[torch.Tensor]:
        if self._parameters is None:
            self._parameters = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in self._shapes]
        return list(self._parameters)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer (same number of elements); the gradients become views of the new one."""
        self._set(tensor)

    # -- helpers
    @property
    def shapes(self) -> List[Shape]:
        return list(self._shapes)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()

    def __repr__(self) -> str:
        return (f"FakeGradBucket(index={self._index}/{self._num_buckets}, tensors={len(self._shapes)}, "
                f"numel={self._buffer.numel()}, dtype={self._buffer.dtype}, device={self._buffer.device})")


def _dtype(dtype) -> torch.dtype:
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def random_buffer(n: int, dtype, device, generator: Optional[torch.Generator] = None, scale: float = 1.0):
    """``n`` standard normal numbers times ``scale`` in ``dtype`` on ``device`` (drawn on ``generator``'s device)."""
    dtype, device = _dtype(dtype), torch.device(device)
    gen_device = generator.device if generator is not None else device
    x = torch.randn(n, generator=generator, device=gen_device, dtype=torch.float32)
    if scale != 1.0:
        x.mul_(scale)
    return x.to(device=device, dtype=dtype)


def shrink_shapes(shapes: Sequence[Shape], div: int) -> List[Shape]:
    """Divide channel/feature dims by ``div`` (not 3x3/7x7 kernel dims) for quick runs; same tensor count."""
    if div <= 1:
        return [tuple(s) for s in shapes]
    out = []
    for s in shapes:
        if len(s) == 4:
            out.append((max(1, s[0] // div), max(1, s[1] // div), s[2], s[3]))
        else:
            out.append(tuple(max(1, d // div) for d in s))
    return out


def model_bucket_shapes(model: str, dtype=torch.float32, bucket_cap_mb: float = 25.0,
                        first_bucket_mb: float = DDP_FIRST_BUCKET_MB, shrink: int = 1) -> List[List[Shape]]:
    """``model``'s gradient shapes split like DDP (reverse order, ``bucket_cap_mb`` MiB, bytes of ``dtype``)."""
    dtype = _dtype(dtype)
    shapes = shrink_shapes(model_shapes(model), shrink)
    esize = torch.empty((), dtype=dtype).element_size()
    return ddp_buckets(shapes, bucket_cap_mb, element_size=esize, first_bucket_mb=first_bucket_mb)


def model_buckets(model: str, dtype=torch.float32, device="cpu", bucket_cap_mb: float = 25.0,
                  first_bucket_mb: float = DDP_FIRST_BUCKET_MB, shrink: int = 1,
                  generator: Optional[torch.Generator] = None) -> List[FakeGradBucket]:
    """Random-filled :class:`FakeGradBucket` s of ``model`` (see :func:`model_bucket_shapes`), bucket 0 first."""
    groups = model_bucket_shapes(model, dtype, bucket_cap_mb, first_bucket_mb, shrink)
    out = []
    for i, shapes in enumerate(groups):
        buf = random_buffer(sum(numel(s) for s in shapes), dtype, device, generator)
        out.append(FakeGradBucket(buf, shapes, index=i, num_buckets=len(groups)))
    return out


def bucket_layout(bucket: FakeGradBucket, rank: int, min_compression_rate: float = 2.0) -> BucketLayout:
    """The layer-wise :class:`BucketLayout` of a bucket, with the hooks' default ``min_compression_rate``."""
    return BucketLayout.from_gradients(bucket.buffer(), bucket.gradients(), rank, min_compression_rate)


def model_bucket_layouts(model: str, rank: int, dtype=torch.float32, device="cpu", *, batched: bool = False,
                         bucket_cap_mb: float = 25.0, first_bucket_mb: float = DDP_FIRST_BUCKET_MB,
                         min_compression_rate: float = 2.0, shrink: int = 1) -> List[BucketLayout]:
    """The :class:`BucketLayout` of each of ``model``'s DDP-like buckets (:func:`model_bucket_shapes`), bucket 0 first.

    ``batched=True``: the batched hook's layout (the whole bucket as one square-ish matrix); else the
    layer-wise hooks' (:func:`bucket_layout` of a :class:`FakeGradBucket` whose buffer is allocated on ``device`` but
    never written: only the gradients' offsets and shapes matter). Raises ``ValueError`` for an unknown model
    (:func:`~powersgd_triton.shapes.model_shapes`), ``KeyError`` for an unknown dtype name (:data:`DTYPES`).
    """
    dtype = _dtype(dtype)
    groups = model_bucket_shapes(model, dtype, bucket_cap_mb, first_bucket_mb, shrink)
    layouts = []
    for i, shapes in enumerate(groups):
        total = sum(numel(s) for s in shapes)
        if batched:
            layouts.append(BucketLayout.batched(total, rank, device, dtype))
            continue
        buffer = torch.empty(total, dtype=dtype, device=device)
        bucket = FakeGradBucket(buffer, shapes, index=i, num_buckets=len(groups))
        layouts.append(bucket_layout(bucket, rank, min_compression_rate))
    return layouts
