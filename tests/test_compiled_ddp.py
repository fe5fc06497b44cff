"""torch.compile'd DDP with our hooks, in each ``torch._dynamo.config.optimize_ddp`` mode the installed torch offers,
and compiled autograd (issue 35), on gloo with 2 ranks.

One spawned pair serves every quick case (``compiled_results``). Where DDP's C++ reducer gives buckets
(``ddp_optimizer``, ``no_optimization``, ``python_reducer_without_compiled_forward``, the bool spellings) the
compiled model's gradients after each step equal the same model's WITHOUT compile, with the same hook, seeds and
state settings, on the same buckets (float32, within 1e-5 of the gradient's scale; ``find_unused_parameters=True``
keeps DDP's first buckets; with DDP's default buckets, rebuilt in the compiled backward's gradient order, against a
run whose first step only is compiled), and the hook really compressed (the elements all-reduced in a compressed
step, counted on ``dist.all_reduce``, are a small part of the gradient and as many as without compile). The
graphs the compile backend receives are counted too (DDPOptimizer: one per bucket). Where it does not
(the python reducer, which calls comm hooks per parameter with ``(grad, param)``; compiled autograd, which DDP's C++
reducer refuses) the user gets one clear line naming what works: from ``register()`` at registration, from the hook
at its first call (python reducer), and torch's own ``RuntimeError`` before any hook runs (compiled autograd with
the C++ reducer; it points at the python reducer, where the hook's line follows). No case issues a collective before
failing, and the pair goes on serving the later cases (no rank left hung or out of step).

DDP reads the mode at construction (``_use_python_reducer``), dynamo when it first traces the compiled model
(DDPOptimizer): each case keeps the mode set for its whole run and starts from ``torch._dynamo.reset()``.
DDPOptimizer asserts that DDP's first bucket (1 MiB) is no larger than ``bucket_cap_mb``: 1 MiB buckets and a
2.2 MB model give 3 buckets.
"""

import contextlib
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.integrations import register

pytestmark = pytest.mark.timeout(300)

HOOKS = {"layerwise": powerSGD_hook, "batched": batched_powerSGD_hook, "alternating": alternating_powerSGD_hook}
STEPS = 4  # 2 warm-up steps (DDP rebuilds its buckets after the first), then 2 compressed steps
START = 2
BUCKET_CAP_MB = 1
TOL = 1e-5  # relative to the largest gradient element of the step (the brief's "within 1e-5")


def _installed_modes():
    import torch._dynamo.utils as dynamo_utils

    return tuple(getattr(dynamo_utils, "_ddp_optimization_mode", ("ddp_optimizer", "python_reducer",
                                                                   "no_optimization")))


MODES = _installed_modes()
# the modes in which DDP keeps its C++ reducer (whole buckets: our hooks run), the bool spellings included
BUCKET_MODES = tuple(m for m in MODES if m != "python_reducer") + (True, False)


class Net(nn.Module):
    """Four linear layers (2.2 MB of float32 parameters: DDP's 3 buckets of 1 MiB). A class of the test's own: dynamo
    skips frames in torch's files (a bare ``nn.Sequential`` under DDP would run eagerly, nothing compiled)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 512)
        self.fc4 = nn.Linear(512, 10)

    def forward(self, x):
        return self.fc4(F.relu(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net()


def _state() -> PowerSGDState:
    return PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=START, backend="torch")


def _data(seed: int, rank: int):
    gen = torch.Generator().manual_seed(seed * 8 + rank)
    return [(torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)) for _ in range(STEPS)]


_GRAPHS = []  # graphs handed to the compile backend in this rank (DDPOptimizer: one per bucket)


def _backend(name: str):
    """A compile backend that counts the graphs it compiles, then compiles them with ``name``'s backend."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def counting(gm, example_inputs):
        _GRAPHS.append(len(gm.graph.nodes))
        return inner(gm, example_inputs)

    return counting


@contextlib.contextmanager
def _dynamo_settings(mode, compiled_autograd: bool = False):
    """``optimize_ddp = mode`` (and ``compiled_autograd``) for the block, from a reset dynamo; restored after."""
    import torch._dynamo as dynamo

    before = (dynamo.config.optimize_ddp, dynamo.config.compiled_autograd)
    dynamo.reset()
    dynamo.config.optimize_ddp = mode
    dynamo.config.compiled_autograd = compiled_autograd
    try:
        yield
    finally:
        dynamo.config.optimize_ddp, dynamo.config.compiled_autograd = before
        dynamo.reset()


@contextlib.contextmanager
def _counting_all_reduce(log: list):
    """Every ``dist.all_reduce`` of the block appends its tensor's element count to ``log``."""
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        log.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield log
    finally:
        dist.all_reduce = original


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _train(models, ddp, data):
    """``STEPS`` SGD steps, step ``i`` through ``models[i]`` (the compiled or the eager DDP); per step the flat
    gradient after the backward and the element counts of the all-reduces issued in it."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    grads, sent = [], []
    for model, (x, y) in zip(models, data):
        opt.zero_grad()
        with _counting_all_reduce([]) as log:
            _loss(model, x, y).backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in ddp.module.parameters()]))
        sent.append(list(log))
        opt.step()
    return grads, sent


def _assignment(state, ddp):
    """The buckets the hook compressed: per bucket index, the positions of its parameters in the model."""
    position = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    return [tuple(position[id(p)] for p in state.buckets[i].params) for i in sorted(state.buckets)]


def _ddp(seed: int, fixed: bool):
    """The DDP of a case: ``fixed`` buckets (``find_unused_parameters=True``: DDP never rebuilds its first buckets),
    else DDP's default (rebuilt after the first step in the order the backward made the gradients)."""
    return DDP(_model(seed), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=fixed)


def _run(seed: int, rank: int, mode, hook: str, backend: str, fixed: bool, compiled_steps: int) -> dict:
    """One training run: the first ``compiled_steps`` steps through ``torch.compile(ddp)``, the rest eager."""
    del _GRAPHS[:]
    with _dynamo_settings(mode):
        ddp = _ddp(seed, fixed)
        state = _state()
        register(ddp, state, HOOKS[hook])
        compiled = torch.compile(ddp, backend=_backend(backend)) if compiled_steps else ddp
        models = [compiled] * compiled_steps + [ddp] * (STEPS - compiled_steps)
        grads, sent = _train(models, ddp, _data(seed, rank))
    return {"grads": grads, "sent": sent, "iter": state.iter, "graphs": len(_GRAPHS),
            "assignment": _assignment(state, ddp), "comm_hook": ddp._get_ddp_logging_data().get("comm_hook"),
            "use_python_reducer": bool(getattr(ddp, "_use_python_reducer", False)),
            "numel": sum(p.numel() for p in ddp.module.parameters())}


def _bucket_case(seed: int, rank: int, mode, hook: str, backend: str, fixed: bool, refs: dict) -> dict:
    """Compiled DDP in a mode with buckets, against the same model and hook without compile (``reference``).

    With DDP's default buckets the compiled backward makes the gradients in another order than the eager one, so
    DDP rebuilds other buckets and PyTorch's per-bucket draw of the first Q differs (another random start, not a
    wrong gradient): there the compressed steps are compared with a run whose first step only is compiled (the same
    rebuilt buckets, then eager), and the eager run's buckets are reported."""
    key = (hook, fixed)
    if key not in refs:
        refs[key] = _run(seed, rank, True, hook, backend, fixed, 0)  # torch's default setting, never compiled
    out = _run(seed, rank, mode, hook, backend, fixed, STEPS)
    ref = refs[key]
    same_buckets = _run(seed, rank, mode, hook, backend, fixed, 1) if not fixed else ref
    out.update(
        diff=[float((g - r).abs().max()) for g, r in zip(out["grads"], same_buckets["grads"])],
        scale=[float(r.abs().max()) for r in same_buckets["grads"]],
        diff_eager=[float((g - r).abs().max()) for g, r in zip(out["grads"], ref["grads"])],
        sent_eager=ref["sent"], assignment_eager=ref["assignment"], assignment_compared=same_buckets["assignment"],
    )
    del out["grads"]
    return out


def _attempt(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def _refused_case(seed: int, rank: int, mode, autograd: str) -> dict:
    """A mode our hooks cannot run in: register()'s refusal, then the hook registered directly and one step run.

    ``autograd``: "eager" (the backward outside compiled code), "config" (``compiled_autograd = True`` and a
    compiled step holding the backward), "enable" (``torch._dynamo.compiled_autograd._enable`` around it; register()
    called inside it too)."""
    from torch._dynamo import compiled_autograd

    x, y = _data(seed, rank)[0]
    out = {}
    with _dynamo_settings(mode, compiled_autograd=(autograd == "config")):
        ddp = DDP(_model(seed), bucket_cap_mb=BUCKET_CAP_MB)
        enable = (lambda: compiled_autograd._enable(torch.compile(backend="aot_eager"))) if autograd == "enable" \
            else contextlib.nullcontext
        with enable():
            out["register"] = _attempt(lambda: register(ddp, _state()))
        state = _state()
        ddp.register_comm_hook(state, powerSGD_hook)
        compiled = torch.compile(ddp, backend="aot_eager")
        if autograd == "config":
            step = torch.compile(lambda a, b: _loss(compiled, a, b).backward(), backend="aot_eager")
        else:
            step = lambda a, b: _loss(compiled, a, b).backward()  # noqa: E731
        with _counting_all_reduce([]) as log, enable():
            out["backward"] = _attempt(lambda: step(x, y))
        out["all_reduces"] = list(log)
        out["iter"] = state.iter
        out["memory"] = len(state.buckets)
        out["use_python_reducer"] = bool(getattr(ddp, "_use_python_reducer", False))
    return out


def _worker(rank, world_size, seed, cases):
    """Each case in turn, then one all-reduce of the ranks' numbers: the ranks are still in step after the refusals
    (a rank that had issued a collective the other did not would hang or mismatch here)."""
    refs, results = {}, {}
    for case in cases:
        if case[0] == "bucket":
            results[case] = _bucket_case(seed, rank, *case[1:], refs=refs)
        else:
            results[case] = _refused_case(seed, rank, *case[1:])
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)
    results["in_step_after"] = float(after) == world_size * (world_size + 1) / 2
    return results


# the bucket cases first: the python reducer changes process-wide settings (inductor's DDP fusion, dynamo's inline
# list of torch.nn.parallel.distributed) that a later case would run under
BUCKET_CASES = [("bucket", mode, "layerwise", "aot_eager", True) for mode in BUCKET_MODES] + [
    ("bucket", "ddp_optimizer", hook, "aot_eager", True) for hook in ("batched", "alternating")] + [
    ("bucket", "ddp_optimizer", "layerwise", "aot_eager", False)]
REFUSED_CASES = [("refused", "ddp_optimizer", "config"), ("refused", "no_optimization", "enable"),
                 ("refused", "python_reducer", "eager"), ("refused", "python_reducer", "config")]


@pytest.fixture(scope="module")
def seed():
    value = int.from_bytes(os.urandom(3), "little")
    print(f"random seed: {value}")
    return value


@pytest.fixture(scope="module")
def compiled_results(tmp_path_factory, seed):
    results = run_ranks(_worker, 2, tmp_path_factory.mktemp("compiled"), seed, BUCKET_CASES + REFUSED_CASES,
                        timeout=240)
    assert all(res["in_step_after"] for res in results)
    return results


def _check_bucket_case(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["comm_hook"] == HOOKS[case[2]].__name__ and r["iter"] == STEPS and not r["use_python_reducer"], r
        assert r["assignment"] == r["assignment_compared"] and len(r["assignment"]) == 3, r
        for step in range(STEPS):
            # the compiled model's gradients are those of the same model and hook without compile (on the same
            # buckets): the first compressed step within 1e-5 of the gradient's scale, the next one tracking it
            tol = TOL if step <= START else 10 * TOL
            assert r["diff"][step] <= tol * r["scale"][step], (rank, step, r["diff"], r["scale"])
        # the hook ran at every step, on whole buckets: a warm-up step all-reduces the whole gradient once (in the
        # end in DDP's 3 buckets); a compressed step far fewer elements (the factors and the biases): the same
        # number as without compile (the same matrices compressed, whichever bucket holds them)
        for step in range(START):
            assert sum(r["sent"][step]) == r["numel"], r["sent"][step]
        assert len(r["sent"][START - 1]) == 3, r["sent"][START - 1]
        for step in range(START, STEPS):
            assert 0 < sum(r["sent"][step]) < r["numel"] / 20, (sum(r["sent"][step]), r["numel"])
            assert sum(r["sent"][step]) == sum(r["sent_eager"][step]), (r["sent"][step], r["sent_eager"][step])
    return results[0][case]


@pytest.mark.parametrize("mode", BUCKET_MODES, ids=str)
def test_layerwise_hook_under_compile_matches_eager(compiled_results, mode):
    r = _check_bucket_case(compiled_results, ("bucket", mode, "layerwise", "aot_eager", True))
    assert r["diff"] == r["diff_eager"]  # fixed buckets: compared with the eager run itself
    if mode in ("ddp_optimizer", True):
        assert r["graphs"] >= 3, r["graphs"]  # DDPOptimizer split the forward at the bucket boundaries
    elif mode in ("no_optimization", False):
        assert r["graphs"] == 1, r["graphs"]  # one graph, the C++ reducer all the same
    else:
        assert r["graphs"] >= 1, r["graphs"]


@pytest.mark.parametrize("hook", ["batched", "alternating"])
def test_other_hooks_under_compile_match_eager(compiled_results, hook):
    r = _check_bucket_case(compiled_results, ("bucket", "ddp_optimizer", hook, "aot_eager", True))
    assert r["diff"] == r["diff_eager"] and r["graphs"] >= 3


def test_default_buckets_under_compile(compiled_results):
    """DDP's default buckets, rebuilt after the first step in the compiled backward's gradient order: the compressed
    steps equal a run on the same buckets (its first step compiled, then eager); the warm-up equals the eager run."""
    case = ("bucket", "ddp_optimizer", "layerwise", "aot_eager", False)
    _check_bucket_case(compiled_results, case)
    for res in compiled_results:
        r = res[case]
        for step in range(START):
            assert r["diff_eager"][step] <= TOL * r["scale"][step], (step, r["diff_eager"])
        if r["assignment"] == r["assignment_eager"]:  # the same buckets as the eager run: the same numbers
            assert r["diff_eager"][START] <= TOL * r["scale"][START], r["diff_eager"]
        print(f"buckets: compiled {r['assignment']}, eager {r['assignment_eager']}")


def _one_line_naming_what_works(message: str):
    assert message is not None and message.startswith("TypeError: ") and "\n" not in message, message
    assert "optimize_ddp='ddp_optimizer'" in message and "compiled_autograd = False" in message, message


@pytest.mark.parametrize("autograd", ["eager", "config"])
def test_python_reducer_is_refused_before_any_collective(compiled_results, autograd):
    for r in (res[("refused", "python_reducer", autograd)] for res in compiled_results):
        assert r["use_python_reducer"]
        _one_line_naming_what_works(r["register"])
        assert "python_reducer" in r["register"]
        # the hook registered directly: called with (grad, param), it raises its line before any collective
        _one_line_naming_what_works(r["backward"])
        assert "(grad, param) tuple" in r["backward"]
        assert r["all_reduces"] == [] and r["iter"] == 0 and r["memory"] == 0, r


@pytest.mark.parametrize("mode,autograd", [("ddp_optimizer", "config"), ("no_optimization", "enable")])
def test_compiled_autograd_with_the_cpp_reducer_is_refused(compiled_results, mode, autograd):
    for r in (res[("refused", mode, autograd)] for res in compiled_results):
        assert not r["use_python_reducer"]
        _one_line_naming_what_works(r["register"])
        assert "compiled autograd" in r["register"] or "compiled_autograd" in r["register"]
        # registered directly: torch's C++ reducer refuses compiled autograd before any hook runs (its message
        # points at the python reducer, where our hook's line above follows); nothing all-reduced, nothing changed
        assert r["backward"] and r["backward"].startswith("RuntimeError: ") and "C++ DDP Reducer" in r["backward"], r
        assert r["all_reduces"] == [] and r["iter"] == 0 and r["memory"] == 0, r


def _cxx_compiler():
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


@pytest.mark.slow
@pytest.mark.skipif(_cxx_compiler() is None, reason="inductor on CPU needs a C++ compiler (g++, c++ or clang++)")
def test_inductor_ddp_optimizer_matches_eager(tmp_path, seed, monkeypatch):
    """The default mode with inductor (C++ kernels on CPU); aot_eager covers the same path in the quick tier."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    case = ("bucket", "ddp_optimizer", "layerwise", "inductor", True)
    results = run_ranks(_worker, 2, tmp_path, seed, [case], timeout=280)
    assert all(res["in_step_after"] for res in results)
    r = _check_bucket_case(results, case)
    assert r["graphs"] >= 3 and r["diff"] == r["diff_eager"], r
