"""A one-device script whose Dataset normalizes each image with an nn.Module, as torchvision's
transforms.Normalize is one: the transform is called on one (3, 4, 4) image before the model's
first forward. A shuffled DataLoader of batch 8, an SGD step."""
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def forward(self, image):
        return (image - self.mean) / self.std


class Images(Dataset):
    def __init__(self, n):
        self.images, self.labels = torch.rand(n, 3, 4, 4), torch.randint(0, 2, (n,))
        self.transform = Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.labels[i]


torch.manual_seed(0)
loader = DataLoader(Images(64), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Flatten(), nn.Linear(48, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    for images, labels in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
print("done")
