"""Lightning ``Trainer.fit`` on 2 CPU processes with ``PowerSGDDDPStrategy`` (run as a script by the tests).

``python tests/_lightning_fit.py OUT_DIR [--epochs N] [--resume CKPT] [--start-method popen|spawn|fork] [--gpu]``:
(``--gpu``: Lightning's own ``DDPStrategy`` on the GPUs, up to 2, as PyTorch's hook is used there) every
rank writes ``OUT_DIR/rank{r}.json`` with what the hook did (``state.iter``, compression stats, the comm hook DDP
logged, the bucket count, warnings raised during training) and ``OUT_DIR/params{r}.pt``; Lightning checkpoints go to
``OUT_DIR/ckpt`` (one per epoch, with the per-rank hook state next to them).
"""

import argparse
import json
import os
import sys
import warnings

import torch

torch.set_num_threads(1)

import pytorch_lightning as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from powersgd_triton import PowerSGDState, powerSGD_hook  # noqa: E402
from powersgd_triton.integrations.lightning import PowerSGDDDPStrategy  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Report(pl.Callback):
    def __init__(self, out):
        self.out = out
        self.caught = None
        self._ctx = None

    def on_train_start(self, trainer, pl_module):
        self._ctx = warnings.catch_warnings(record=True)
        self.caught = self._ctx.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self._ctx.__exit__(None, None, None)
        strategy = trainer.strategy
        state = strategy._ddp_comm_state
        rate, before, after = state.compression_stats()
        rank = trainer.global_rank
        info = {
            "rank": rank,
            "world_size": trainer.world_size,
            "iter": state.iter,
            "global_step": trainer.global_step,
            "stats": [rate, before, after],
            "comm_hook": strategy.model._get_ddp_logging_data().get("comm_hook"),
            "buckets": len(state.buckets),
            "errors_nonzero": sum(int(torch.count_nonzero(e)) for e in state.error_dict.values()),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in self.caught
                         if issubclass(w.category, RuntimeWarning) and "PowerSGD" in str(w.message)],
        }
        torch.save([p.detach().clone() for p in pl_module.parameters()], os.path.join(self.out, f"params{rank}.pt"))
        with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
            json.dump(info, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--start-method", default="popen")
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 32, generator=g), torch.randn(128, 4, generator=g))
    state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3,
                          backend="auto" if args.gpu else "torch")
    strategy_cls = pl.strategies.DDPStrategy if args.gpu else PowerSGDDDPStrategy
    strategy = strategy_cls(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook, start_method=args.start_method)
    trainer = pl.Trainer(
        accelerator="gpu" if args.gpu else "cpu",
        devices=min(2, torch.cuda.device_count()) if args.gpu else 2,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Report(args.out),
            pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_top_k=-1,
                                         filename="{epoch}"),
        ],
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
