"""``powersgd-triton train --outer diloco --sync-every H``: DiLoCo on torchft, with and without PowerSGD.

The command starts a torchft lighthouse in this process and ``--world-size`` replica groups of one rank each, as
threads of this process (gloo on CPU), each with its own torchft ``Manager``; it stops them all at the end. Each
replica trains its own shard of the data (the DDP rows' per-rank batches) with the workload's optimizer (the inner
optimizer, the same schedule) and every ``H`` steps syncs through torchft's ``DiLoCo`` (full-precision outer
gradients) or :class:`~powersgd_triton.integrations.torchft.PowerSGDDiLoCo` (rank ``--matrix-approximation-rank``,
bfloat16 factors unless ``--communication-dtype`` says otherwise); the outer optimizer is SGD with Nesterov momentum
(``--outer-lr``, ``--outer-momentum``: 0.5 and 0.5 by default). The bytes are counted at ``Manager.allreduce`` (what one replica hands
to it, per outer sync). ``--compare`` runs ``diloco``, ``diloco+powersgd`` and ``ddp+powersgd`` (plain DDP with our
``powersgd`` hook, every step a sync) from the same seed; accuracy is the global model's (the parameters of the last
sync) on the test set.
"""

import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from datetime import timedelta
from typing import Any, Dict, List

import torch

from powersgd_triton.cli_common import text_table

# the outer optimizer's defaults (--outer-lr, --outer-momentum; Nesterov when the momentum is not 0): the DiLoCo
# paper's 0.7 / 0.9 is for LLMs and many syncs; on mnist5k (24 syncs) it overshoots (test accuracy 0.941 full
# precision, 0.842 with PowerSGD rank 4), 0.5 / 0.5 gives 0.946 and 0.937 (2026-12-04, this command)
OUTER_LR, OUTER_MOMENTUM = 0.5, 0.5
ROWS = ("diloco", "diloco+powersgd", "ddp+powersgd")
LABELS = {
    "diloco": "DiLoCo, full-precision outer gradients (torchft)",
    "diloco+powersgd": "DiLoCo + PowerSGD on the outer gradients (PowerSGDDiLoCo)",
    "ddp+powersgd": "DDP + our powerSGD_hook (every step a sync)",
}


class InjectedFailure(RuntimeError):
    """A replica killed on purpose (``--debug-fail-rank R --debug-fail-step S``: torchft's failure injection)."""


def _replica(name: str, replica: int, cfg, sync_every: int, data, lighthouse: str, barrier,
             outer_lr: float, outer_momentum: float) -> Dict[str, Any]:
    """One replica group of one rank: trains, syncs every ``sync_every`` steps, returns its metrics. With
    ``cfg.fail_rank == replica`` it raises at inner step ``cfg.fail_step`` (once) and restarts as torchft's replicas do:
    a fresh model and manager, the data from the start of the interval it died in (its local steps there are
    replaced when it heals from a peer at the next sync's quorum: model, inner and outer optimizers, our Q)."""
    from powersgd_triton.train.loop import training_plan

    n_items, per_epoch, total = training_plan(cfg, data)
    run = {"step": 0, "sent": 0, "syncs": 0, "losses": [], "restarts": 0, "t0": None}
    for attempt in range(2):
        try:
            return _replica_attempt(name, replica, cfg, sync_every, data, lighthouse, barrier if attempt == 0 else None,
                                    outer_lr, outer_momentum, run, (n_items, per_epoch, total), inject=attempt == 0)
        except InjectedFailure:
            run["restarts"] += 1
            run["step"] -= run["step"] % sync_every  # the interval it died in is trained again, then healed over
            del run["losses"][run["step"]:]
    raise AssertionError("unreachable: the failure is injected once")


def _replica_attempt(name: str, replica: int, cfg, sync_every: int, data, lighthouse: str, barrier,
                     outer_lr: float, outer_momentum: float, run: Dict[str, Any], plan, inject: bool) -> Dict[str, Any]:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from powersgd_triton import PowerSGDState
    from powersgd_triton.integrations.torchft import PowerSGDDiLoCo
    from powersgd_triton.train import data as data_mod
    from powersgd_triton.train.loop import _schedule, batch_loss, evaluate, rank_batch
    from powersgd_triton.train.models import build_model

    with _SEED_LOCK:  # the replicas are threads: the global RNG seeds the weights under a lock
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.workload, data)
    if cfg.optimizer == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    store = torch.distributed.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=cfg.collective_timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=cfg.world_size, use_async_quorum=False,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica{replica}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, port=0, init_sync=False, timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout)
    allreduce = manager.allreduce

    def counted(tensor, *args, **kwargs):  # what this replica hands to Manager.allreduce
        run["sent"] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted
    n_items, per_epoch, total = plan
    try:
        kwargs = dict(backup_device=torch.device("cpu"), pin_memory=False)
        if name == "diloco+powersgd":
            dtype = {"float32": torch.float32, "float16": torch.float16}.get(cfg.communication_dtype or "",
                                                                             torch.bfloat16)
            state = PowerSGDState(None, matrix_approximation_rank=cfg.matrix_approximation_rank, start_powerSGD_iter=2,
                                  use_error_feedback=cfg.use_error_feedback, warm_start=cfg.warm_start,
                                  min_compression_rate=cfg.min_compression_rate,
                                  # the replicas are threads: not Triton's interpreter (not thread-safe) on CPU
                                  backend="torch" if cfg.kernels == "auto" else cfg.kernels,
                                  communication_dtype=dtype, random_seed=cfg.seed)
            diloco = PowerSGDDiLoCo(manager, [model], inner, outer, sync_every, state=state, **kwargs)
        else:
            diloco = DiLoCo(manager, [model], inner, outer, sync_every, **kwargs)
        if barrier is not None:
            barrier.wait()
        if run["t0"] is None:
            run["t0"] = time.perf_counter()
        with diloco:
            perm_epoch, perm = None, None
            while run["step"] < total:
                step = run["step"]
                if inject and cfg.fail_rank == replica and step == cfg.fail_step:
                    raise InjectedFailure(f"replica {replica} killed at step {step} (--debug-fail-rank)")
                epoch, i = divmod(step, per_epoch)
                if epoch != perm_epoch:
                    perm_epoch, perm = epoch, data_mod.epoch_permutation(n_items, cfg.seed, epoch)
                for group in inner.param_groups:
                    group["lr"] = _schedule(total, cfg.lr, step)
                x, y = rank_batch(cfg, data, perm, i, epoch, replica, torch.device("cpu"))
                loss = batch_loss(cfg, model, x, y)
                inner.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
                inner.step()  # DiLoCo's post-hook syncs every sync_every steps
                run["losses"].append(float(loss.detach()))
                run["step"] = step = step + 1
                if step % sync_every == 0:
                    run["syncs"] += 1
        seconds = time.perf_counter() - run["t0"]
        frag = diloco._fragments[0]
        with torch.no_grad():  # the global model: the parameters of the last sync
            for n, p in model.named_parameters():
                p.copy_(frag.original_parameters[n])
        ev = evaluate(model, cfg, data, torch.device("cpu")) if replica == 0 else {}
        committed = manager.current_step()
    finally:
        manager.shutdown(wait=False)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    syncs = run["syncs"]
    out = {"hook": name, "steps": total, "outer_syncs": committed, "outer_syncs_attempted": syncs,
           "sync_every": sync_every, "allreduce_bytes_total": run["sent"],
           "allreduce_bytes_per_outer_sync": run["sent"] / max(1, syncs), "gradient_bytes": gradient_bytes,
           "seconds_total": seconds, "seconds_per_step": seconds / max(1, total), "loss": run["losses"],
           "replica_restarts": run["restarts"]}
    if ev:
        out.update(final_test_accuracy=ev["accuracy"], final_test_loss=ev["loss"])
        if "bits_per_char" in ev:
            out["final_test_bits_per_char"] = ev["bits_per_char"]
    return out


_SEED_LOCK = threading.Lock()


def train_diloco(name: str, cfg, sync_every: int, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM) -> Dict[str, Any]:
    """One DiLoCo run (``name``: ``diloco`` or ``diloco+powersgd``) on ``cfg.world_size`` replicas; replica 0's
    metrics (its test metrics are the global model's), with the other replicas' byte counts checked equal."""
    from torchft.coordination import LighthouseServer

    from powersgd_triton.train import data as data_mod

    torch.set_num_threads(1)
    data = data_mod.load_workload(cfg.workload, cfg.seed)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.world_size)
    barrier = threading.Barrier(cfg.world_size)
    try:
        with ThreadPoolExecutor(max_workers=cfg.world_size) as pool:
            futures = [pool.submit(_replica, name, r, cfg, sync_every, data, lighthouse.address(), barrier, outer_lr,
                                   outer_momentum) for r in range(cfg.world_size)]
            for f in as_completed(futures, timeout=cfg.timeout):
                if f.exception() is not None:  # the others' next quorum fails at once instead of timing out
                    lighthouse.shutdown()
                    barrier.abort()
                    raise f.exception()
            results = [f.result() for f in futures]
    finally:
        lighthouse.shutdown()
    out = results[0]
    out["allreduce_bytes_per_replica"] = [r["allreduce_bytes_total"] for r in results]
    out["replica_restarts"] = sum(r["replica_restarts"] for r in results)
    return out


def run_diloco(cfg, sync_every: int, compare: bool, outer_lr: float = OUTER_LR,
               outer_momentum: float = OUTER_MOMENTUM) -> Dict[str, Any]:
    """The runs of ``--outer diloco``: ``{"runs": {row: metrics}, "config": {...}}`` (rows: :data:`ROWS` with
    ``compare``, else ``diloco+powersgd``, or ``diloco`` with ``--hook allreduce``)."""
    from powersgd_triton.train.loop import _config_json, run_training

    quiet_torchft()
    try:
        import torchft.local_sgd  # noqa: F401
    except Exception as exc:
        raise ValueError(f"--outer diloco needs torchft (pip install 'powersgd-triton[torchft]'): {exc}") from None
    if cfg.device != "cpu":
        raise ValueError("--outer diloco runs its replicas on the CPU (gloo): drop --device cuda")
    if not (outer_lr > 0 and 0 <= outer_momentum < 1):
        raise ValueError(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {outer_lr}, {outer_momentum}")
    if compare:
        names = ROWS
    else:
        names = ("diloco",) if cfg.hooks == ("allreduce",) else ("diloco+powersgd",)
    runs: Dict[str, Any] = {}
    for name in names:
        print(f"[{name}] {LABELS[name]} ...", flush=True)
        if name == "ddp+powersgd":
            # the failure injection is DiLoCo's (a replica restarts and heals); DDP's would end the run
            ddp = run_training(replace(cfg, hooks=("powersgd",), fail_rank=None))["runs"]["powersgd"]
            ddp["hook"] = name
            ddp["outer_syncs"] = ddp["steps"]
            ddp["allreduce_bytes_total"] = sum(ddp["allreduce_bytes"])
            ddp["allreduce_bytes_per_outer_sync"] = ddp["allreduce_bytes_per_step"]
            runs[name] = ddp
        else:
            runs[name] = train_diloco(name, cfg, sync_every, outer_lr, outer_momentum)
        print(f"[{name}] done: test acc {runs[name].get('final_test_accuracy', float('nan')):.4f}", flush=True)
    config = _config_json(cfg)
    config.update(outer="diloco", sync_every=sync_every, outer_optimizer=f"SGD(lr={outer_lr}, "
                  f"momentum={outer_momentum}, nesterov={outer_momentum > 0})", hook_labels={n: LABELS[n] for n in names})
    return {"runs": runs, "config": config}


class _NoFlightRecorder(logging.Filter):
    """Drops torchft's warning that it cannot reset NCCL's flight recorder (printed at every quorum on gloo)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def quiet_torchft() -> None:
    """torchft's progress logs off for the command: its Rust side logs every quorum at INFO (hundreds of lines a
    run; the level is read once, when torchft is first imported: ``RUST_LOG=info`` set by the user still wins), and
    its manager warns about NCCL's flight recorder at every quorum on gloo. Warnings and errors still show."""
    os.environ.setdefault("RUST_LOG", "warn")
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorder) for f in logger.filters):
        logger.addFilter(_NoFlightRecorder())


def format_table(result: Dict[str, Any]) -> str:
    """The side-by-side table (markdown) of ``--outer diloco``'s runs."""
    runs, cfg = result["runs"], result["config"]
    charlm = cfg["workload"] == "charlm"
    base = runs.get("diloco")
    head = ["run", "final test acc", "test bits/char" if charlm else "test loss", "outer syncs",
            "all-reduced/outer sync/replica", "all-reduced total/replica"]
    if base:
        head.append("bytes/sync vs diloco")
    rows = []
    for name, run in runs.items():
        metric = run.get("final_test_bits_per_char") if charlm else run.get("final_test_loss")
        row = [LABELS.get(name, name), f"{run['final_test_accuracy']:.4f}", f"{metric:.4f}",
               str(run["outer_syncs"]), _fmt(run["allreduce_bytes_per_outer_sync"]),
               _fmt(run["allreduce_bytes_total"])]
        if base:
            per = run["allreduce_bytes_per_outer_sync"]
            if name == "diloco":
                row.append("1x")
            else:
                row.append(f"{base['allreduce_bytes_per_outer_sync'] / per:.1f}x fewer" if per else "-")
        rows.append(row)
    any_run = next(iter(runs.values()))
    title = (f"{cfg['workload']}: {cfg['world_size']} replicas (torchft, gloo, cpu), sync every {cfg['sync_every']} "
             f"steps, matrix approximation rank {cfg['matrix_approximation_rank']}, {any_run['steps']} steps, batch "
             f"{cfg['batch_size']}/replica, seed {cfg['seed']}")
    notes = ["bytes: handed to Manager.allreduce by one replica (DDP: dist.all_reduce per rank, per compressed step), "
             "averaged over the outer syncs; accuracy: the global model after the last sync",
             f"outer optimizer {cfg['outer_optimizer']}; inner: the workload's optimizer and schedule"]
    restarts = {n: r["replica_restarts"] for n, r in runs.items() if r.get("replica_restarts")}
    if restarts:
        notes.append(f"replica {cfg['fail_rank']} killed at step {cfg['fail_step']} (--debug-fail-rank), restarted and "
                     f"healed from a peer at the next sync: {', '.join(restarts)}")
    return "\n".join([title, "", text_table(head, rows), ""] + [f"* {n}" for n in notes])


def _fmt(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
