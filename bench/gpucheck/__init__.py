"""ONE command for a GPU run of powersgd_triton: compiles, correctness, non-finite inputs, bandwidth, hook step.

    PYTHONPATH=. python bench/gpu_check.py --quick      # on the GPU machine, from a bare checkout: <= 245 s
    PYTHONPATH=. python bench/gpu_check.py              # the full run, < 6 min
    PYTHONPATH=. python bench/gpu_check.py --dry-run    # CPU + Triton interpreter, tiny shapes (the CI smoke test)

Needs only torch, triton and numpy (nothing to install; platformdirs, filelock, tqdm are used when present).
Sections (each one catches and records its own failures, then the run goes on; every item checks the time left):

1. ``env``: versions, GPU name, SMs, L2, driver and clocks.
2. ``compile``: every kernel variant the later sections launch is compiled first, under its own budget, so the timed
   sections start warm. On a GPU: worker processes (one per CPU core, up to 16) each run a share of the later
   sections' items once (same shapes, dtypes, ranks and configs; the ``verify`` and ``streams`` sections' hook steps
   included), which fills Triton's on-disk cache; then per
   compiled binary its compile seconds, registers, spills, shared memory, warps/stages and blocks per SM
   (``tools.aot.resource_usage``: ``ptxas -v``) beside the loaded kernel's ``n_regs``/``n_spills``. In the dry
   run: the same kernels are compiled ahead of time for sm_90 (``python -m tools.aot --plan``) for
   the same tables; the interpreter runs the checks.
3. ``copy``: the device's copy bandwidth, a large ``copy_`` timed with ``triton.testing.do_bench`` (median),
   counting bytes read + written.
4. ``correctness``: every kernel variant against a float64 torch oracle on fresh random inputs, outputs poisoned with
   NaN before the launch (every element must be written), regions outside the compressed matrices checked untouched;
   real ResNet-50 and GPT-2 buckets, ragged shapes (with an all-zero layer) and the batched view; ranks 1/4/16; fp32,
   bf16, fp16; also the local-residual reconstruct (alternating hook) and the pack/unpack of uncompressed gradients.
5. ``nonfinite``: every kernel variant in every gradient dtype on inputs holding +-inf and NaNs with the payloads
   GPUs produce (``0x7FFFFFFF``, ``0xFFFFFFFF`` as float32; ``0x7FFF``, ``0xFFFF`` as bf16/fp16) besides the
   canonical one: each output must be non-finite exactly where the float64 oracle's is, and finite elements right.
6. ``kernels``: each kernel's achieved bandwidth (byte model: bytes read + written, once each) on the 25 MB buckets
   of ResNet-50 (and GPT-2 in the full run), as a fraction of the measured copy bandwidth; PyTorch's hook's code for
   the same step beside it (rank 4).
7. ``hooks``: the whole hook step (every bucket of the model) of PyTorch's ``powerSGD_hook`` against ours (Triton
   backend), rank 4 fp32 and bf16 (full run: also rank 1/16 and GPT-2): ``do_bench`` median over two rotating copies
   of the buckets, device kernels per step (``torch.profiler``), Triton launches, ATen ops, all-reduce calls and
   bytes, memory held per bucket and peak extra memory of a step.
8. ``model`` (before ``copy``, right after ``compile``): the performance model's predictions for every kernel and hook
   item (its ahead-of-time compiles, ``ptxas -v`` and ``cuobjdump``, run here under their own cap); the ``kernels`` and
   ``hooks`` sections only look them up, so no compile runs inside a timed section.
9. ``paths`` (after ``correctness``): the GPU heuristic's own configs on the paths most likely to differ on a GPU --
   ``project_t``'s split tensor-core path (``SPLIT_BF16``, bf16/fp16 gradients at rank 8 and 16), ``reconstruct`` and
   ``project`` with ``tl.dot``, ``orthogonalize``'s float64 Gram launch (factors longer than ``SHORT_ROWS``, in place
   too) and its ``APPLY_ROWS`` split -- against float64, each checking that the path was taken.
10. ``verify``: the first-use check (``PowerSGDState(..., verify="first")``): no warning on correct kernels, a
    warning and the torch backend's outputs when a kernel computes wrong numbers; skipped, with the reason, where
    ``PowerSGDState`` takes no ``verify``.
11. ``streams`` (after ``verify``, with the checks): ``torch.cuda._sleep`` injected at the top of every NCCL ``then()``
    callback and before every orthogonalization on the next-Q side stream (``ops.orthogonalize`` and the Triton
    backend's ``TritonSteps.orthogonalize``), NaN scribbled on the default stream meanwhile; the hook's outputs (3
    buckets, 4 compressed steps, both hooks, fp32 and bf16) must match the torch backend's by value and the
    uninjected run bitwise, and each row must have delayed callbacks and side-stream orthogonalizations. On CPU (dry
    run) the same rows run on gloo on tiny buckets with a counting sleep and the next-Q orthogonalization standing in
    for the side stream; the GPU check is listed as skipped.

The sections live one per room in ``bench/gpucheck/`` (``common``: arguments, budgets, results, timing; ``main``: the
order); ``bench/gpu_check.py`` is the entry point.

``--quick`` keeps what matters (every kernel's correctness and non-finite checks, the GPU paths, the first-use check,
the sleep injection, ResNet-50 25 MB bucket bandwidth at rank 4 fp32, the ResNet-50 hook step at rank 4 fp32 and
bf16). Prints progress as it goes and a markdown summary at
the end; writes ``gpu_check.json`` and ``gpu_check.md`` into ``$OUT`` (or ``--out``) after every section, so a run cut
short still leaves its results; every skipped item is listed with its reason. Budget of ``--quick``: 215 s of sections
(80 s of them compiling), stopped 30 s after that whatever hangs: within 5 minutes with Python's and CUDA's start. Targets (not asserted): hook step >= 5x
faster than PyTorch's on an H100/H200; each kernel >= 60 % of the copy bandwidth on 25 MB buckets. Exit status 1 when
a check failed (correctness, paths, verify, nonfinite, streams) or a section raised.
"""
