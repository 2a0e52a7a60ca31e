"""A Lightning Trainer script over torchvision's ImageFolder, as Lightning's docs suggest.

    python benchmarks/peers/lightning_imagefolder.py FOLDER --epochs 3 --batch-size 128 --gpus N
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its clock starts the whole job)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class Classifier(L.LightningModule):
    def __init__(self, classes: int, lr: float):
        super().__init__()
        self.net, self.lr = common.model(classes), lr

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


class EpochTimer(L.Callback):
    """Each epoch's training seconds. Lightning calls on_train_epoch_end only after the epoch's
    validation, so the clock stops when validation starts (the sanity check aside)."""
    def __init__(self):
        self.seconds = []
        self.began = None

    def on_train_epoch_start(self, trainer, module):
        self.began = time.perf_counter()

    def _stop(self):
        if self.began is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self.began)
            self.began = None

    def on_validation_epoch_start(self, trainer, module):
        if not trainer.sanity_checking:
            self._stop()

    def on_train_epoch_end(self, trainer, module):
        self._stop()  # an epoch without validation


def main():
    a = common.args()
    gpus = a.gpus
    train, val = common.datasets(a.folder)
    loaders = [DataLoader(d, batch_size=a.batch_size, shuffle=s, num_workers=a.workers, pin_memory=True,
                          persistent_workers=a.workers > 0) for d, s in ((train, True), (val, False))]
    timer = EpochTimer()
    trainer = L.Trainer(accelerator="gpu", devices=gpus, strategy="ddp" if gpus > 1 else "auto",
                        precision="bf16-mixed", max_epochs=a.epochs, callbacks=[timer],
                        enable_progress_bar=False, logger=False)
    trainer.fit(Classifier(len(train.classes), a.lr), *loaders)
    if trainer.global_rank == 0:
        acc = trainer.callback_metrics.get("val_acc")
        common.report("lightning", timer.seconds, None if acc is None else float(acc))


if __name__ == "__main__":
    main()
