"""The corpus of issue 38: public one-GPU scripts, unmodified, run by
benchmarks/auto_public_scripts.py --corpus under `multigpu run --auto` on CPU.

Chosen before the first run (this list was committed first). 13 scripts from 6 repositories,
none from pytorch/examples or yunjey/pytorch-tutorial (the README's figures use those). Each is
pinned by repository, commit and the git blob id of the file; the scripts are fetched, not
committed: `python benchmarks/auto_corpus.py --materialise MIRRORS` writes each one, byte for
byte, from `MIRRORS/<owner>+<name>/repo` (a bare git directory of that repository, holding the
pinned commit) to `.public/corpus/<name>/` and checks its blob id; the harness checks it again
before it runs anything.

Why these: each is a well-known tutorial or reference script, written for one device, that runs
as published on a CPU machine (`torch.device('cuda' if available else 'cpu')`, `.cuda()` only
when CUDA is there, or no device code at all) and trains in seconds on small data. Between them
they cover what one-GPU scripts do: shuffled MNIST / FashionMNIST / CIFAR-10 loaders with hard-
coded epochs, a peek at a loader before training (`next(iter(loader))`), GANs with two optimizers
and `save_image` every few batches, tensorboard's SummaryWriter, `torch.save(state_dict)`,
full-batch training on in-memory tensors, `get_batch()` language models, a script that forms its
own process group under torchrun's variables (nanoGPT), and hand-written SGD with no optimizer.
Considered and left out: mohammadpz/pytorch_forward_forward (calls `.cuda()` unconditionally:
it cannot run on a CPU machine, under --auto or not); karpathy/ng-video-lecture's gpt.py (5000
steps of a 6-layer GPT: too slow on 2 shared cores); L1aoXingyu/pytorch-beginner's CNN, RNN,
autoencoder and GAN scripts (`loss.data[0]`, `Variable(volatile=True)`: they fail on torch >= 0.5
as published); aladdinpersson/Machine-Learning-Collection (the repository is too large to fetch
here).

Data: each script's data is generated (benchmarks/auto_public_data.py) in the layout it reads, at
the path it reads it from (relative to its working directory): `data` lists (layout, path, train,
test). The sizes are small so that the scripts' hard-coded epochs take seconds.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = "corpus"  # under --scripts (.public/ by default): .public/corpus/<name>/<file>


@dataclass(frozen=True)
class Pin:
    repo: str    # owner/name on GitHub
    commit: str
    path: str    # the file's path in the repository
    blob: str    # its git blob id at that commit

    @property
    def file(self) -> str:
        return Path(self.path).name


@dataclass(frozen=True)
class Entry:
    name: str
    pin: Pin
    metric: str                # a regex on the script's own output, one group: the metric
    metric_label: str
    data: tuple = ()           # (layout, path relative to the run's cwd, train, test)
    args: tuple = ()           # the script's own arguments, the same in every run
    beside: tuple = ()         # Pins the script reads from its cwd: copied there, byte for byte
    metric_mean_of_last: int = 1   # the mean of the last K matches (K: one epoch's prints)
    note: str = ""

    def pins(self) -> list[Pin]:
        return [self.pin, *self.beside]


def _pin(repo: str, commit: str, path: str, blob: str) -> Pin:
    return Pin(repo, commit, path, blob)


_BEGINNER = ("L1aoXingyu/pytorch-beginner", "a57dd7ea35c9965a41f4963dee62d38884f92a65")
_PL = ("patrickloeber/pytorchTutorial", "69637721ed9fa2ccf81a1093a928a52bbb591439")
_NG = ("karpathy/ng-video-lecture", "52201428ed7b46804849dea0b3ccf0de9df1a5c3")
_NANO = ("karpathy/nanoGPT", "3adf61e154c3fe3fca428ad6bc3818b27a3b8291")
_GAN = ("eriklindernoren/PyTorch-GAN", "36d3c77e5ff20ebe0aeefd322326a134a279b93e")
_JJ = ("jcjohnson/pytorch-examples", "0003fcdc606a79951e53bf8f46f8574fa4739f23")

_GAN_ARGS = ("--n_epochs", "3", "--sample_interval", "8", "--n_cpu", "1")
_GAN_D_LOSS = r"\[D loss: ([-\d.e+]+)\]"
_TEST_ACC = r"Test Loss: [-\d.naif]+, Acc: ([\d.]+)"
_VAL_LOSS = r"step \d+: train loss [\d.]+, val loss ([\d.]+)"

CORPUS = {e.name: e for e in [
    Entry("beginner-logistic", _pin(*_BEGINNER, "02-Logistic Regression/Logistic_Regression.py",
                                    "6c58eb5ace1c07cf0924fdf382e133a84207c83d"),
          _TEST_ACC, "test accuracy (fraction)", data=(("fashion-mnist", "../datasets", 256, 128),),
          note="FashionMNIST, 100 epochs hard-coded, batch 64, SGD; torch.save(state_dict)"),
    Entry("beginner-mlp", _pin(*_BEGINNER, "03-Neural Network/neural_network.py",
                               "f728a0ea3de32257b7036d09993561f548727d97"),
          _TEST_ACC, "test accuracy (fraction)", data=(("fashion-mnist", "../datasets", 256, 128),),
          note="FashionMNIST, 50 epochs hard-coded, batch 64, SGD; torch.save(state_dict)"),
    Entry("pl-logistic", _pin(*_PL, "08_logistic_regression.py",
                              "a164e8731b97e19ca1535d7dca28b27dbafdc54c"),
          r"accuracy: ([\d.]+)", "test accuracy (fraction)",
          note="sklearn's bundled breast-cancer set, full batch, no DataLoader, 100 SGD steps"),
    Entry("pl-feedforward", _pin(*_PL, "13_feedforward.py",
                                 "29507b28edbf06b223c0da88738669be768d8bc9"),
          r"Accuracy of the network on the 10000 test images: ([\d.]+) %", "test accuracy %",
          data=(("mnist", "data", 1000, 500),),
          note="MNIST, 2 epochs, batch 100, Adam; next(iter(test_loader)) and plt.show() first"),
    Entry("pl-cnn", _pin(*_PL, "14_cnn.py", "a4abbd1a3a21b73d9dcbc2518613a5826367e6b3"),
          r"Accuracy of the network: ([\d.]+) %", "test accuracy %",
          data=(("cifar10", "data", 400, 200),),
          note="CIFAR-10, 5 epochs, batch 4, SGD; peeks at the shuffled training loader; "
               "torch.save(state_dict); its test loop indexes range(batch_size)"),
    Entry("pl-tensorboard", _pin(*_PL, "16_tensorboard.py",
                                 "94462f50d629b2b2e13e831ba5a9a5579407dc57"),
          r"Accuracy of the network on the 10000 test images: ([\d.]+) %", "test accuracy %",
          data=(("mnist", "data", 1000, 500),),
          note="MNIST, 1 epoch, batch 64; SummaryWriter('runs/mnist1'): add_image, add_graph "
               "(traces the model), add_scalar, add_pr_curve"),
    Entry("ng-bigram", _pin(*_NG, "bigram.py", "faa3a14a6aca9c36d31d155b95aa4cf5a1d28860"),
          _VAL_LOSS, "val loss", data=(("text", "input.txt", 60000, 0),),
          note="get_batch() from a tensor (no DataLoader), torch.manual_seed(1337), 3000 steps"),
    Entry("nanogpt-char", _pin(*_NANO, "train.py", "de5785051050d64bbda37a4964c2c079f0739b2b"),
          _VAL_LOSS, "val loss", data=(("shakespeare-char", "data/shakespeare_char", 60000, 6000),),
          args=("config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                "--dtype=float32", "--eval_iters=5", "--log_interval=10", "--block_size=32",
                "--batch_size=8", "--n_layer=2", "--n_head=2", "--n_embd=64", "--max_iters=60",
                "--lr_decay_iters=60", "--eval_interval=20", "--dropout=0.0"),
          beside=(_pin(*_NANO, "model.py", "c698f8b60129d793494de058b0dd4e318c0dcb5e"),
                  _pin(*_NANO, "configurator.py", "a8bba9599537cbb34b378399a077b525a87d497f"),
                  _pin(*_NANO, "config/train_shakespeare_char.py",
                       "41c81dfb4ea48523199e774ff1f309d9ab1a1181")),
          note="its README's CPU recipe, smaller; forms its own process group where RANK is set"),
    Entry("gan", _pin(*_GAN, "implementations/gan/gan.py",
                      "d6f1d935e9273d3c692a1ad33082d54c69ec8507"),
          _GAN_D_LOSS, "D loss, mean of the last epoch's batches", metric_mean_of_last=8,
          data=(("mnist", "../../data/mnist", 512, 64),), args=_GAN_ARGS,
          note="MNIST, two Adam optimizers, BatchNorm1d; save_image to images/ every 8 batches"),
    Entry("dcgan", _pin(*_GAN, "implementations/dcgan/dcgan.py",
                        "46e64c0674686c6849bac33c54f4e75227077e75"),
          _GAN_D_LOSS, "D loss, mean of the last epoch's batches", metric_mean_of_last=8,
          data=(("mnist", "../../data/mnist", 512, 64),), args=_GAN_ARGS,
          note="as gan, convolutional, BatchNorm2d, weights_init_normal through model.apply"),
    Entry("cgan", _pin(*_GAN, "implementations/cgan/cgan.py",
                       "9e32b7c058181ffddecd6b47fa82325410614cfc"),
          _GAN_D_LOSS, "D loss, mean of the last epoch's batches", metric_mean_of_last=8,
          data=(("mnist", "../../data/mnist", 512, 64),), args=_GAN_ARGS,
          note="conditional GAN (label embedding), MSE loss; its sample_image() calls the "
               "generator on a 10x10 grid"),
    Entry("jj-optim", _pin(*_JJ, "nn/two_layer_net_optim.py",
                           "84a7f2ed6b0b3a7bf930117d87ea9d11ab4611c0"),
          r"^499 ([\d.e+-]+)$", "training loss at step 499",
          note="random x, y made in the script (unseeded), no DataLoader, "
               "MSELoss(reduction='sum'), Adam, 500 full-batch steps"),
    Entry("jj-nn", _pin(*_JJ, "nn/two_layer_net_nn.py",
                        "ec4f897060772107c8db794c711ca8f81e346188"),
          r"^499 ([\d.e+-]+)$", "training loss at step 499",
          note="as jj-optim, with hand-written SGD (param.data -= lr * grad): no optimizer"),
]}


def blob_id(body: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()


def script_path(entry: Entry, scripts: Path) -> Path:
    return scripts / FOLDER / entry.name / entry.pin.file


def pin_path(entry: Entry, pin: Pin, scripts: Path) -> Path:
    """Where a pinned file lies under --scripts: the script by its file name, the files beside it
    at their paths in the repository relative to the script's folder."""
    base = scripts / FOLDER / entry.name
    if pin == entry.pin:
        return base / pin.file
    return base / Path(pin.path).relative_to(Path(entry.pin.path).parent)


def materialise(mirrors: Path, scripts: Path, names: list[str]) -> int:
    """Each pinned file, from its repository's git directory, byte for byte; blob ids checked."""
    bad = 0
    for name in names:
        entry = CORPUS[name]
        for pin in entry.pins():
            git_dir = mirrors / pin.repo.replace("/", "+") / "repo"
            body = subprocess.run(["git", f"--git-dir={git_dir}", "show",
                                   f"{pin.commit}:{pin.path}"], check=True,
                                  capture_output=True).stdout
            target = pin_path(entry, pin, scripts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            ok = blob_id(body) == pin.blob
            bad += not ok
            print(f"{'ok' if ok else 'BLOB DIFFERS'} {name}: {pin.repo}@{pin.commit[:10]} "
                  f"{pin.path} -> {target}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--materialise", metavar="MIRRORS", required=True,
                   help="folder of <owner>+<name>/repo git directories")
    p.add_argument("--scripts", default=str(REPO / ".public"))
    p.add_argument("--only", default=",".join(CORPUS))
    args = p.parse_args(argv)
    return materialise(Path(args.materialise), Path(args.scripts), args.only.split(","))


if __name__ == "__main__":
    sys.exit(main())
