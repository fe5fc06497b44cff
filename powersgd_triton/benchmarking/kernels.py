"""The four bucket steps alone, on one bucket: :class:`KernelBench` (ours, :mod:`powersgd_triton.ops`, and PyTorch's
hook's equivalent code) and the byte model :func:`kernel_bytes` (bytes read + written, each once).
"""

from typing import Callable, Optional

import torch

from powersgd_triton.layout import BucketLayout
from powersgd_triton.benchmarking.buckets import FakeGradBucket, _dtype, bucket_layout, random_buffer


def kernel_bytes(kernel: str, layout: BucketLayout, grad_dtype, *, error: bool = True, factor_size: int = 4) -> int:
    """Fewest bytes a bucket step must move (each input read once, each output written once).

    ``M``: the compressed matrices (``layout.e_numel`` elements of ``grad_dtype``); ``E``: their float32 error
    memory; ``P``/``Q``: ``factor_size`` bytes per element.

    =================  ===================================================
    project            read M (+ E), write M + E if error, read Q, write P
    orthogonalize      read P, write P
    project_t          read M, read P, write Q
    reconstruct        read P, Q (+ M), write M (+ E)
    =================  ===================================================
    """
    es = torch.empty((), dtype=_dtype(grad_dtype)).element_size()
    mn, p, q = layout.e_numel, layout.p_numel * factor_size, layout.q_numel * factor_size
    if kernel == "project":
        return mn * es + q + p + ((mn * 4 + mn * es) if error else 0)
    if kernel == "orthogonalize":
        return 2 * p
    if kernel == "project_t":
        return mn * es + p + q
    if kernel == "reconstruct":
        return p + q + mn * es + ((mn * es + mn * 4) if error else 0)
    raise ValueError(f"unknown kernel {kernel!r}")


class KernelBench:
    """The four bucket steps alone, on one bucket: ours (:mod:`powersgd_triton.ops`) and PyTorch's hook's code.

    Ours: float32 ``P``/``Q``/error of the compressed matrices; the bucket's matrices are views (no copies).
    PyTorch's equivalents (``batch_tensors_with_same_shape=False``, its default) work per matrix in the bucket's
    dtype:

    * ``project``: ``input += error`` (whole bucket), ``clone()`` of the bucket, one ``bmm`` per matrix;
    * ``orthogonalize``: ``_orthogonalize`` per matrix (Gram-Schmidt for r <= 2 or 16-bit, else ``linalg.qr``);
    * ``project_t``: one ``bmm`` per matrix;
    * ``reconstruct``: one ``bmm`` per matrix, then ``error = clone - input``.

    All inputs are random (never zeros); the error memory is small so that repeated ``project`` calls stay finite.
    """

    def __init__(self, bucket: FakeGradBucket, rank: int, *, min_compression_rate: float = 2.0,
                 generator: Optional[torch.Generator] = None, epsilon: float = 0.0):
        self.bucket = bucket
        self.rank = rank
        self.epsilon = epsilon
        buf = bucket.buffer()
        self.device, self.dtype = buf.device, buf.dtype
        self.layout = bucket_layout(bucket, rank, min_compression_rate)
        lay = self.layout
        f32 = torch.float32
        self.p = random_buffer(lay.p_numel, f32, self.device, generator)
        self.q = random_buffer(lay.q_numel, f32, self.device, generator)
        self.error = random_buffer(lay.e_numel, f32, self.device, generator, scale=1e-3)
        self.flag = torch.ones((), dtype=torch.bool, device=self.device)
        # PyTorch's side
        self.pt_error = random_buffer(buf.numel(), self.dtype, self.device, generator, scale=1e-3)
        self.pt_p = random_buffer(lay.p_numel, self.dtype, self.device, generator)
        self.pt_q = random_buffer(lay.q_numel, self.dtype, self.device, generator)
        self.pt_clone = buf.clone()
        self._mats, self._ps, self._qs = [], [], []
        for s in lay.matrices:
            self._mats.append(buf[s.offset : s.offset + s.n * s.m].view(1, s.n, s.m))
            self._ps.append(self.pt_p[s.p_offset : s.p_offset + s.n * s.rank].view(1, s.n, s.rank))
            self._qs.append(self.pt_q[s.q_offset : s.q_offset + s.m * s.rank].view(1, s.m, s.rank))

    def bytes(self, kernel: str) -> int:
        return kernel_bytes(kernel, self.layout, self.dtype, error=True)

    def ours(self, kernel: str, backend: str = "torch", config: Optional[dict] = None) -> Callable[[], None]:
        from powersgd_triton import ops

        buf, lay = self.bucket.buffer(), self.layout
        if kernel == "project":
            return lambda: ops.project(buf, lay, self.q, self.p, self.error, backend=backend, config=config)
        if kernel == "orthogonalize":
            out = torch.empty_like(self.p)  # out of place, as the hooks call it (in place ignores APPLY_ROWS)
            return lambda: ops.orthogonalize(self.p, lay, "p", self.epsilon, out, backend=backend, config=config)
        if kernel == "project_t":
            return lambda: ops.project_t(buf, lay, self.p, self.q, backend=backend, config=config)
        if kernel == "reconstruct":
            return lambda: ops.reconstruct(buf, lay, self.p, self.q, 1.0, self.error, self.flag, backend=backend,
                                           config=config)
        raise ValueError(f"unknown kernel {kernel!r}")

    def pytorch(self, kernel: str) -> Callable[[], None]:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        buf = self.bucket.buffer()
        mats, ps, qs = self._mats, self._ps, self._qs

        def project():
            buf.add_(self.pt_error)
            self.pt_clone = buf.detach().clone()
            for m, q, p in zip(mats, qs, ps):
                torch.bmm(m, q, out=p)

        def orthogonalize():
            for p in ps:
                _orthogonalize(p, self.epsilon)

        def project_t():
            for m, p, q in zip(mats, ps, qs):
                torch.bmm(m.transpose(1, 2), p, out=q)

        def reconstruct():
            for p, q, m in zip(ps, qs, mats):
                torch.bmm(p, q.transpose(1, 2), out=m)
            self.pt_error = self.pt_clone - buf

        table = {"project": project, "orthogonalize": orthogonalize, "project_t": project_t,
                 "reconstruct": reconstruct}
        if kernel not in table:
            raise ValueError(f"unknown kernel {kernel!r}")
        return table[kernel]
