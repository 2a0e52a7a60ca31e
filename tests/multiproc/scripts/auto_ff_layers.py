"""Forward-forward training as mohammadpz/pytorch_forward_forward writes it, made small: each
Layer (an nn.Linear) has its own optimizer and trains itself by calling `self.forward(x)`, never
`layer(x)`; the Net keeps its layers in a plain list and overrides train() with its own
arguments, as that script does. The training data is one shuffled batch of the whole set
(`next(iter(loader))`); prediction calls the layers as modules, with gradients on.

For the tests it writes weights_rank<RANK>.json: the sample indices it trained on, the final
weights of each layer and its prediction accuracy.
"""
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def overlay(x, y):
    """x with its label written into its first two features (one-hot), as forward-forward does."""
    x = x.clone()
    x[:, :2] = 0.0
    x[range(x.shape[0]), y] = 3.0  # the repo writes x.max(), a statistic of the batch
    return x


class Layer(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.opt = torch.optim.SGD(self.parameters(), lr=0.05)
        self.threshold, self.num_epochs = 2.0, 15

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return torch.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for _ in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log(1 + torch.exp(torch.cat([-g_pos + self.threshold,
                                                      g_neg - self.threshold]))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


class Net(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = [Layer(dims[d], dims[d + 1]) for d in range(len(dims) - 1)]

    def predict(self, x):
        goodness_per_label = []
        for label in range(2):
            h, goodness = overlay(x, torch.full((x.shape[0],), label)), []
            for layer in self.layers:
                h = layer(h)  # through the module, gradients on, no backward
                goodness += [h.pow(2).mean(1)]
            goodness_per_label += [sum(goodness).unsqueeze(1)]
        return torch.cat(goodness_per_label, 1).argmax(1)

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for layer in self.layers:
            h_pos, h_neg = layer.train(h_pos, h_neg)


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    y = (x[:, 2] > 0).long()
    return x, y


def main():
    torch.manual_seed(0)
    x_all, y_all = dataset()
    net = Net([8, 16, 16])
    loader = DataLoader(TensorDataset(x_all, y_all, torch.arange(32)), batch_size=32, shuffle=True)
    x, y, idx = next(iter(loader))
    net.train(overlay(x, y), overlay(x, 1 - y))
    accuracy = net.predict(x).eq(y).float().mean().item()
    print("train accuracy:", accuracy)
    record = {"indices": idx.tolist(), "accuracy": accuracy,
              "weights": [{k: v.tolist() for k, v in layer.state_dict().items()}
                          for layer in net.layers]}
    with open(f"weights_rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
