"""PowerSGD on DiLoCo's outer gradients through torchft (powersgd_triton.integrations.torchft).

torchft's own DiLoCo integration cases (torchft/local_sgd_integ_test.py: healthy, recovery, streaming recovery, commit
failure, upscale) ported with compression on, two or three replica groups of one rank as threads on gloo with a
lighthouse in process (tests/_torchft_run.py); each asserts values: replicas bitwise equal (global parameters, outer
optimizer, our warm-start Q) at every step both recorded; a discarded sync changes neither the parameters nor our
memory. An equivalence test against a float64 torch reference of compressed DiLoCo on 2 replicas, and the compressor's
state dict checks.
"""

import pytest
import torch

try:
    import torchft.local_sgd  # noqa: F401
except Exception as exc:  # absent (the compat tier's py3.10 pairs), or not importable with this torch
    pytest.skip(f"torchft not importable (optional extra [torchft]): {type(exc).__name__}: {exc}",
                allow_module_level=True)

import _torchft_run as R  # noqa: E402
from powersgd_triton import PowerSGDState  # noqa: E402
from powersgd_triton.integrations.outer_powersgd import OuterPowerSGD, initial_q  # noqa: E402
from powersgd_triton.layout import should_compress  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _assert_replicas_equal(results, fragments: int, min_common: int = 1, final: bool = True):
    """Replicas bitwise equal at every step both recorded (the global parameters, the outer optimizer, our Q) and,
    with ``final`` (one fragment: its parameters are the global ones after the last sync), at the end."""
    base = results[0]["records"]
    for other in results[1:]:
        common = sorted(set(base) & set(other["records"]))
        assert len(common) >= min_common, (sorted(base), sorted(other["records"]))
        for step in common:
            a, b = base[step], other["records"][step]
            for i in range(fragments):
                key = f"StreamingDiLoCoFragment_{i}"
                for name, t in a["global"][key]["original_parameters"].items():
                    assert torch.equal(t, b["global"][key]["original_parameters"][name]), (step, i, name)
                qa, qb = a["q"][f"PowerSGDDiLoCo_{i}"]["buckets"], b["q"][f"PowerSGDDiLoCo_{i}"]["buckets"]
                for ba, bb in zip(qa, qb):
                    assert ba["q_initialized"] == bb["q_initialized"]
                    assert torch.equal(ba["q"], bb["q"]), (step, i)
                _assert_nested_equal(a["global"][key]["outer_optimizer"], b["global"][key]["outer_optimizer"])
        for name, t in results[0]["final"].items() if final else ():
            assert torch.equal(t, other["final"][name]), name


def _assert_nested_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_nested_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_nested_equal(x, y)
    else:
        assert a == b


def _bytes_per_sync(config) -> int:
    """What one compressed sync of the whole test model all-reduces: the uncompressed tensors in their dtype, P and
    Q in the communication dtype."""
    net = R.model(config)
    state = PowerSGDState(None, matrix_approximation_rank=config.rank, start_powerSGD_iter=2, backend="torch")
    wire = torch.tensor([], dtype=config.communication_dtype or config.dtype).element_size()
    total = 0
    for i, block in enumerate(net):
        comp = OuterPowerSGD(state, list(block.named_parameters()), i)
        for b in comp.buckets:
            lay = b.layout
            assert lay.num_matrices > 0  # the test model is compressed
            total += lay.uncompressed_numel * b.buffer.element_size() + (lay.p_numel + lay.q_numel) * wire
    return total


def test_diloco_healthy():
    config = R.Config(steps=4)
    results = R.run(config)
    _assert_replicas_equal(results, 1, min_common=4)
    for r in results:
        assert r["outer_syncs"] == 4 and r["failed_syncs"] == 0 and r["failed"] == []
        assert r["bytes"] == 4 * _bytes_per_sync(config)
        errors = [b["error"] for f in r["memory"]["fragments"] for b in f["buckets"]]
        assert all(e is not None and float(e.abs().sum()) > 0 for e in errors)  # error feedback ran
    # the error memory is per replica: different on the two
    ea = results[0]["memory"]["fragments"][0]["buckets"][0]["error"]
    eb = results[1]["memory"]["fragments"][0]["buckets"][0]["error"]
    assert not torch.equal(ea, eb)


def test_diloco_recovery():
    """Replica 1 fails at step 2, restarts, heals from replica 0 (its Q, a zero error memory) and continues."""
    results = R.run(R.Config(steps=4, fail_at={1: 2}))
    assert results[1]["failures"] == 1
    _assert_replicas_equal(results, 1, min_common=2)
    for r in results:
        assert r["failed"] == [] or all(all(v for k, v in c.items() if k != "fragment") for c in r["failed"])


def test_diloco_commit_failure():
    """Both replicas' all-reduce fails at step 1: the sync is discarded (parameters and memory as before it), then
    retried and committed."""
    results = R.run(R.Config(steps=3, fail_allreduce_at={0: 1, 1: 1}))
    for r in results:
        assert r["failed_syncs"] >= 1 and r["outer_syncs"] == 3
        assert r["failed"], "no discarded sync was seen"
        for check in r["failed"]:
            assert check["params_back"] and check["global_kept"] and check["memory_kept"], check
    _assert_replicas_equal(results, 1)


@pytest.mark.parametrize("delay,alpha", [(0, 0.0), (1, 0.5)])
def test_streaming_diloco_commit_failure(delay, alpha):
    config = R.Config(fragments=2, sync_every=4, steps=4, fail_allreduce_at={0: 1, 1: 1},
                      diloco={"fragment_sync_delay": delay, "fragment_update_alpha": alpha})
    results = R.run(config)
    for r in results:
        assert r["failed"] and all(c["global_kept"] and c["memory_kept"] for c in r["failed"]), r["failed"]
    _assert_replicas_equal(results, 2, final=False)


def test_streaming_diloco_recovery():
    results = R.run(R.Config(fragments=2, sync_every=4, steps=4, fail_at={1: 2},
                             diloco={"fragment_sync_delay": 1}))
    assert results[1]["failures"] == 1
    _assert_replicas_equal(results, 2, min_common=2, final=False)


@pytest.mark.slow
def test_streaming_diloco_upscale():
    """A third replica joins after two steps (heals from a peer) and stays bitwise equal to the others."""
    results = R.run(R.Config(replicas=3, fragments=2, sync_every=4, steps=4, barrier_at={0: 0, 1: 2, 2: 2},
                             diloco={"fragment_sync_delay": 1}))
    _assert_replicas_equal(results, 2, min_common=2, final=False)


@pytest.mark.slow
def test_diloco_deterministic_across_runs():
    first, second = R.run(R.Config(steps=3)), R.run(R.Config(steps=3))
    for name, t in first[0]["final"].items():
        assert torch.equal(t, second[0]["final"][name])


# ---------------------------------------------------------------- equivalence with a float64 reference
def _orth(x: torch.Tensor) -> torch.Tensor:
    q, r = torch.linalg.qr(x)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _reference(config, syncs: int, compress: bool = True):
    """Compressed DiLoCo on ``config.replicas`` replicas in float64, written from the algorithm: H inner SGD steps
    per replica, outer gradient M = global - local, per compressed matrix P = Σ(M + E)·orth(Q), Q = Σ(M + E)ᵀ·orth(P)
    / replicas, M̂ = orth(P)·Qᵀ, E ← M + E - M̂; the rest averaged; outer SGD with Nesterov momentum on M̂."""
    glob = R.model(config)
    outer = torch.optim.SGD(glob[0].parameters(), lr=0.7, momentum=0.9, nesterov=True)
    names = [n for n, _ in glob[0].named_parameters()]
    params = dict(glob[0].named_parameters())
    compressed = [n for n in names if compress and params[n].dim() == 2
                  and should_compress(*params[n].shape, min(config.rank, *params[n].shape), 2)[0]]
    q_numel = sum(params[n].shape[1] * config.rank for n in compressed)
    flat = initial_q(config.seed, 0, 0, 0, q_numel, torch.float64)
    qs, pos = {}, 0
    for n in compressed:
        m = params[n].shape[1]
        qs[n] = flat[pos : pos + m * config.rank].view(m, config.rank).clone()
        pos += m * config.rank
    errors = [{n: torch.zeros_like(params[n]) for n in compressed} for _ in range(config.replicas)]
    step = [0] * config.replicas
    for _ in range(syncs):
        outer_grads = []
        for r in range(config.replicas):
            local = R.model(config)
            local.load_state_dict(glob.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=config.inner_lr)
            for _ in range(config.sync_every):
                x, y = R.batch(r, step[r], config.dtype)
                step[r] += 1
                loss = torch.nn.functional.mse_loss(local(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            lp = dict(local[0].named_parameters())
            outer_grads.append({n: (params[n] - lp[n]).detach() for n in names})
        avg = {}
        for n in names:
            if n not in compressed:
                avg[n] = sum(g[n] for g in outer_grads) / config.replicas
                continue
            me = [g[n] + e[n] for g, e in zip(outer_grads, errors)]
            p = _orth(sum(x @ _orth(qs[n]) for x in me))
            q = sum(x.T @ p for x in me) / config.replicas
            avg[n] = p @ q.T
            for e, x in zip(errors, me):
                e[n] = x - avg[n]
            qs[n] = q
        for n in names:
            params[n].grad = avg[n].clone()
        outer.step()
        outer.zero_grad()
    return {n: t.detach() for n, t in glob.state_dict().items()}


def test_equivalence_with_float64_reference():
    config = R.Config(dtype=torch.float64, communication_dtype=None, steps=3, init_sync=False)
    results = R.run(config)
    expected = _reference(config, 3)
    for r in results:
        assert r["outer_syncs"] == 3
        for name, t in expected.items():
            torch.testing.assert_close(r["final"][name], t, rtol=1e-9, atol=1e-12, msg=name)
    # and it is not plain DiLoCo: the low-rank step differs from the one on averaged outer gradients
    plain = _reference(config, 3, compress=False)
    assert not torch.allclose(results[0]["final"]["0.0.weight"], plain["0.0.weight"], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- the compressor's state dict
def _compressor(rank=2):
    net = R.model(R.Config())
    state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2, backend="torch")
    return OuterPowerSGD(state, list(net[0].named_parameters()), 0)


def test_state_dict_round_trip_and_recovery_rule():
    a, b = _compressor(), _compressor()
    for bucket in a.buckets:
        bucket.q.copy_(torch.randn(bucket.q.shape))
        bucket.error.copy_(torch.randn(bucket.error.shape))
        bucket.q_initialized = True
    b.load_state_dict(a.state_dict())
    for x, y in zip(a.buckets, b.buckets):
        assert torch.equal(x.q, y.q) and torch.equal(x.error, y.error) and y.q_initialized
    b.load_state_dict(a.state_dict(error=False), zero_error=True)  # a replica healing from a peer
    for x, y in zip(a.buckets, b.buckets):
        assert torch.equal(x.q, y.q) and not y.error.any()


@pytest.mark.parametrize("damage", ["nan", "size", "names"])
def test_damaged_state_dict_changes_nothing(damage):
    a, b = _compressor(), _compressor()
    for bucket in a.buckets:
        bucket.q.copy_(torch.randn(bucket.q.shape))
    before = [x.q.clone() for x in b.buckets]
    sd = a.state_dict()
    entry = sd["buckets"][0]
    if damage == "nan":
        entry["q"][0] = float("nan")
    elif damage == "size":
        entry["q"] = entry["q"][1:]
    else:
        entry["names"] = entry["names"][::-1]
    with pytest.raises(ValueError):
        b.load_state_dict(sd)
    assert all(torch.equal(x.q, y) for x, y in zip(b.buckets, before))


def test_refusals():
    from powersgd_triton.integrations.torchft import PowerSGDDiLoCo

    with pytest.raises(ValueError, match="should_quantize"):
        PowerSGDDiLoCo(None, [], None, None, 2, should_quantize=True)
    state = PowerSGDState(None, start_powerSGD_iter=2, grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="grad_scaler"):
        OuterPowerSGD(state, [("w", torch.zeros(4, 4))])
