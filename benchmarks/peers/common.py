"""What the three whole-job peer scripts share: their command line, torchvision's ImageFolder with
the transforms its docs show, and the line each prints at the end (time_to_train.sh reads it).
The model is multigpu's resnet50 (the architecture of torchvision's), so that every script trains
the same network as `multigpu train --model resnet50`."""
import argparse
import json
import time

START = time.perf_counter()


def args():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per GPU")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--gpus", type=int, default=1, help="Lightning: devices (the others: torchrun's)")
    return p.parse_args()


def datasets(folder: str):
    from torchvision import datasets as tvd
    from torchvision import transforms as T

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = tvd.ImageFolder(f"{folder}/train", T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val = tvd.ImageFolder(f"{folder}/val", T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    return train, val


def model(classes: int):
    from multigpu.train.models.catalog import build_model

    return build_model("resnet50", (3, 224, 224), classes)


def report(name: str, epochs: list[float], val_accuracy: float | None) -> None:
    """One JSON line: the whole job from the script's first line, and each epoch's seconds."""
    print("RESULT " + json.dumps({"script": name, "whole_s": round(time.perf_counter() - START, 2),
                                  "epoch_s": [round(e, 2) for e in epochs], "val_accuracy": val_accuracy}),
          flush=True)
