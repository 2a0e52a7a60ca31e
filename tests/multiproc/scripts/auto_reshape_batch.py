"""A one-device MNIST-style script that writes its batch size into a shape, as some tutorials do:
`images.reshape(batch_size, -1)` with the batch_size it gave its DataLoader. Under --auto's
global batch each of 2 processes reads batch_size / 2 samples, so the reshape makes 100 rows of
392 and the first Linear fails; --auto stops it at that first step in one line.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

batch_size = 100


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 32), nn.Linear(32, 10)

    def forward(self, x):
        out = torch.relu(self.fc1(x))  # the failing line
        return self.fc2(out)


torch.manual_seed(0)
data = TensorDataset(torch.randn(200, 1, 28, 28), torch.randint(0, 10, (200,)))
train_loader = DataLoader(data, batch_size=batch_size, shuffle=True)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for images, labels in train_loader:
    images = images.reshape(batch_size, -1)
    loss = nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(model.state_dict(), "model.pt")
