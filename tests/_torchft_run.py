"""Replica groups of one rank on torchft, as threads of this process (torchft's own integration tests' way: a
lighthouse in process, one ``Manager`` on gloo per replica), training with :class:`PowerSGDDiLoCo`.

``run(config)`` starts ``config.replicas`` replicas, each running :func:`train` (restarted after an injected failure,
as torchft's ``Runner`` does) and returns what each recorded: per manager step, the global state (every fragment's
parameters at the last sync, its outer optimizer, our Q) and this replica's memory; the checks made at every failed
sync; the final parameters.
"""

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchft._torchft import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import FakeProcessGroupWrapper, ProcessGroupGloo

from powersgd_triton import PowerSGDState
from powersgd_triton.integrations.torchft import PowerSGDDiLoCo, STATE_KEY


class InjectedFailure(Exception):
    pass


@dataclass
class Config:
    replicas: int = 2
    fragments: int = 1
    sync_every: int = 2
    steps: int = 4  # manager steps (committed outer syncs) to reach
    dtype: torch.dtype = torch.float32
    rank: int = 2
    communication_dtype: Optional[torch.dtype] = torch.bfloat16
    diloco: dict = field(default_factory=dict)
    fail_at: Dict[int, int] = field(default_factory=dict)  # replica -> manager step where it raises (once)
    fail_allreduce_at: Dict[int, int] = field(default_factory=dict)  # replica -> step of an all-reduce error (once)
    barrier_at: Dict[int, int] = field(default_factory=dict)  # replica -> step where it waits for the others
    init_sync: bool = True
    inner_lr: float = 0.05
    seed: int = 0


class InjectingPG(FakeProcessGroupWrapper):
    """torchft's failure-injecting wrapper, with an all-reduce error the manager sees: torchft 0.2.0's
    ``report_future_error`` raises in a future nobody waits for (the returned work completes normally), so its commit
    failure case commits. Here the armed all-reduce runs (the peers are not left waiting) and then raises, which
    ``Manager.allreduce`` reports: the rest of the sync's all-reduces are no-ops and ``should_commit()`` is false."""

    def __init__(self, pg):
        super().__init__(pg)
        self.fail_next = False

    def allreduce(self, tensors, opts):
        work = super().allreduce(tensors, opts)
        if self.fail_next:
            self.fail_next = False
            work.wait()
            raise RuntimeError("injected allreduce error")
        return work


def model(config: Config) -> nn.Module:
    """``fragments`` blocks of Linear layers with distinct shapes (the weights compressed at rank 2, the biases and
    the last block's small weight all-reduced as they are)."""
    blocks = []
    for f in range(config.fragments):
        blocks.append(nn.Sequential(nn.Linear(12 if f == 0 else 6, 16), nn.Tanh(), nn.Linear(16, 10), nn.Tanh(),
                                    nn.Linear(10, 6 if f < config.fragments - 1 else 4)))
    net = nn.Sequential(*blocks).to(config.dtype)
    g = torch.Generator().manual_seed(config.seed)  # not the global RNG: the replicas are threads
    with torch.no_grad():
        for p in net.parameters():
            p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1) / p.shape[-1] ** 0.5)
    return net


def batch(replica: int, step: int, dtype):
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(8, 12, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(8, 4, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def _clone(obj):
    return copy.deepcopy(obj)


def train(replica: int, config: Config, lighthouse: str, events: dict, barrier, joined) -> dict:
    net = model(config)
    inner = torch.optim.SGD(net.parameters(), lr=config.inner_lr)
    outers = [torch.optim.SGD(b.parameters(), lr=0.7, momentum=0.9, nesterov=True) for b in net]
    holder = {}

    def load_state_dict(sd):
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    def state_dict():
        return {"model": net.state_dict(), "inner": inner.state_dict()}

    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    pg = InjectingPG(ProcessGroupGloo(timeout=timedelta(seconds=10)))
    manager = Manager(pg=pg, min_replica_size=2, use_async_quorum=False, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=str(replica), store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse, port=0, init_sync=config.init_sync,
                      connect_timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10),
                      timeout=timedelta(seconds=10))
    state = PowerSGDState(None, matrix_approximation_rank=config.rank, start_powerSGD_iter=2, backend="torch",
                          communication_dtype=config.communication_dtype, random_seed=config.seed)
    if events.get(("barrier", (replica, 0))):  # the replica that joins late: tell the others when it asks to join
        start_quorum = manager.start_quorum

        def start_quorum_and_tell(*args, **kwargs):
            joined.set()
            return start_quorum(*args, **kwargs)

        manager.start_quorum = start_quorum_and_tell
    records, failed_checks = {}, []
    try:
        with PowerSGDDiLoCo(manager, list(net), inner, outers, config.sync_every, state=state, backup_device=None,
                            pin_memory=False, **config.diloco) as diloco:
            holder["d"] = diloco
            snap = None
            last = None
            local = 0
            while manager.current_step() < config.steps:
                step = manager.current_step()
                key = (replica, step)
                if events.get(("fail", key)):
                    events[("fail", key)] = False
                    raise InjectedFailure(f"replica {replica} at step {step}")
                if events.get(("allreduce", key)):
                    events[("allreduce", key)] = False
                    pg.fail_next = True
                if events.get(("barrier", key)):
                    events[("barrier", key)] = False
                    barrier.wait()
                    if step > 0:  # the others wait until the joiner asks for a quorum (else they may finish first)
                        joined.wait(timeout=60)
                if step not in records:
                    user = manager._manager_state_dict()["user"]
                    records[step] = {
                        "global": _clone({k: v for k, v in user.items() if k.startswith("StreamingDiLoCoFragment")}),
                        "q": _clone({k: v for k, v in user.items() if k.startswith(STATE_KEY.format(""))}),
                        "memory": diloco.state_dict(),
                    }
                if not any(c.in_flight for c in diloco.compressors):
                    snap = (diloco.state_dict(), [_clone(f.original_parameters) for f in diloco._fragments])
                x, y = batch(replica, local, config.dtype)
                local += 1
                loss = nn.functional.mse_loss(net(x), y)
                inner.zero_grad()
                loss.backward()
                inner.step()
                if diloco.last_sync is not None and diloco.last_sync is not last:
                    last = diloco.last_sync
                    frag, committed = last
                    if not committed:  # a discarded sync: neither the parameters nor our memory changed
                        failed_checks.append(_unchanged(diloco, frag, snap))
                    diloco.last_sync = None
                    last = None
        return {"records": records, "failed": failed_checks, "final": _clone(net.state_dict()),
                "outer_syncs": diloco.outer_syncs, "failed_syncs": diloco.failed_syncs,
                "bytes": diloco.allreduce_bytes, "memory": diloco.state_dict()}
    finally:
        manager.shutdown(wait=False)


def _unchanged(diloco, frag: int, snap) -> dict:
    before_memory, before_params = snap
    fragment = diloco._fragments[frag]
    params_back = all(torch.equal(p.detach(), before_params[frag][n])
                      for n, p in fragment._model_fragment.named_parameters())
    global_kept = all(torch.equal(fragment.original_parameters[n], before_params[frag][n])
                      for n in before_params[frag])
    memory = diloco.state_dict()
    mem_kept = all(_equal(a, b) for a, b in zip(_tensors(memory), _tensors(before_memory)))
    return {"fragment": frag, "params_back": params_back, "global_kept": global_kept, "memory_kept": mem_kept}


def _tensors(sd):
    for f in sd["fragments"]:
        for b in f["buckets"]:
            yield b["q"]
            yield b["error"]


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def run(config: Config, attempts: int = 3) -> List[dict]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    events = {}
    for r, s in config.fail_at.items():
        events[("fail", (r, s))] = True
    for r, s in config.fail_allreduce_at.items():
        events[("allreduce", (r, s))] = True
    for r, s in config.barrier_at.items():
        events[("barrier", (r, s))] = True
    barrier = threading.Barrier(len(config.barrier_at)) if config.barrier_at else None
    joined = threading.Event()
    lock = threading.Lock()
    failures = [0] * config.replicas

    def replica_main(r: int) -> dict:
        for attempt in range(attempts):
            try:
                out = train(r, config, lighthouse.address(), events, barrier, joined)
                out["failures"] = failures[r]
                return out
            except InjectedFailure:
                with lock:
                    failures[r] += 1
        raise RuntimeError(f"replica {r} ran out of attempts")

    try:
        with ThreadPoolExecutor(max_workers=config.replicas) as pool:
            futures = [pool.submit(replica_main, r) for r in range(config.replicas)]
            return [f.result(timeout=300) for f in futures]
    finally:
        lighthouse.shutdown()
