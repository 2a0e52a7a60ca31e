"""A one-device training script with its own WebDataset pipeline and no multigpu in it:
`auto_webdataset_train.py SHARDS_DIR none|split_by_node`, the WebDataset's nodesplitter
(None: every process reads every shard; split_by_node: webdataset's own share of the shards per
rank). It trains a tiny model on each sample's label and writes the keys this process trained
on (seen_rank<RANK>.json), for the tests only. `multigpu run --auto` runs it as it is.
"""
import json
import os
import sys
from pathlib import Path

import torch
import webdataset as wds
from torch import nn
from torch.utils.data import DataLoader

shards, splitter = Path(sys.argv[1]), sys.argv[2]
urls = sorted(str(p) for p in shards.glob("train-*.tar"))
torch.manual_seed(0)
data = wds.WebDataset(urls, shardshuffle=False, empty_check=False,
                      nodesplitter=None if splitter == "none" else wds.split_by_node)
data = data.map(lambda s: (torch.tensor([float(s["cls"])]), s["__key__"]))
loader = DataLoader(data, batch_size=4)
model = nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
seen = []
for x, keys in loader:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), x).backward()
    optimizer.step()
    seen.append(list(keys))
Path(f"seen_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))
