"""A one-GPU script shaped as pytorch/examples' MNIST is (written here, not copied): on CUDA both
loaders get num_workers=1, pin_memory=True and shuffle=True, the test loader included; the test
pass runs under torch.no_grad() and divides its count by len(test_loader.dataset); StepLR; the
state dict and the whole model saved at the end. Synthetic data: no torchvision needed.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, 1)
        self.fc = nn.Linear(8 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def classes(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    return TensorDataset(templates[y] + torch.randn(n, 1, 28, 28, generator=g), y)


def test(model, device, loader):
    model.eval()
    correct, seen = 0, 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            correct += model(data).argmax(dim=1).eq(target).sum().item()
            seen += len(target)
    print(f"Test set: Accuracy: {correct}/{len(loader.dataset)}, evaluated {seen}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(1)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    train_kwargs, test_kwargs = {"batch_size": 64}, {"batch_size": 100}
    if use_cuda:
        cuda_kwargs = {"num_workers": 1, "pin_memory": True, "shuffle": True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)
    train_loader = DataLoader(classes(1024, 1), **train_kwargs)
    test_loader = DataLoader(classes(300, 2), **test_kwargs)
    model = Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    for _ in range(args.epochs):
        model.train()
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        test(model, device, test_loader)
        scheduler.step()
    torch.save(model.state_dict(), "mnist_cnn.pt")
    torch.save(model, "whole.pt")
    print("reloaded", type(torch.load("whole.pt", weights_only=False)).__name__)


if __name__ == "__main__":
    main()
