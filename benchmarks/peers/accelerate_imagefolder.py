"""An Accelerate script over torchvision's ImageFolder, as Accelerate's docs show.

    torchrun --nproc_per_node N benchmarks/peers/accelerate_imagefolder.py FOLDER --epochs 3
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its clock starts the whole job)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def main():
    a = common.args()
    accelerator = Accelerator(mixed_precision="bf16")
    train, val = common.datasets(a.folder)
    train_loader = DataLoader(train, batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
                              pin_memory=True, persistent_workers=a.workers > 0)
    val_loader = DataLoader(val, batch_size=a.batch_size, num_workers=a.workers, pin_memory=True)
    model = common.model(len(train.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=1e-4)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    epochs = []
    for _ in range(a.epochs):
        began = time.perf_counter()
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the epoch's queued GPU work belongs to its seconds
        epochs.append(time.perf_counter() - began)
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                pred, y = accelerator.gather_for_metrics((model(x).argmax(1), y))
                correct, total = correct + int((pred == y).sum()), total + len(y)
    if accelerator.is_main_process:
        common.report("accelerate", epochs, correct / max(total, 1))
    accelerator.end_training()


if __name__ == "__main__":
    main()
