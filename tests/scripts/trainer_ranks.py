"""Trainer on N ranks: prints its last record and rank 0's own count over the whole val set."""

import json
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import disttrain
from disttrain.trainer import Trainer

checkpoint_dir = sys.argv[1]
strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
g = torch.Generator().manual_seed(0)
x = torch.randn(160, 4, generator=g)
y = (x[:, 0] + x[:, 1] > 0).long()
train = TensorDataset(x[:119], y[:119])
val = TensorDataset(x[119:], y[119:])  # 41 samples: 21 + 20 on two ranks
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
trainer = Trainer(model, optimizer,
                  DataLoader(train, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)),
                  DataLoader(val, batch_size=8), F.cross_entropy, metrics=("top1",),
                  checkpoint_dir=checkpoint_dir, log_every=5, strategy=strategy)
history = trainer.fit(2)
with torch.no_grad():  # on every rank: a sharded model's forward is a collective
    hits = int((trainer.model(val.tensors[0]).argmax(1) == val.tensors[1]).sum())
if disttrain.context().is_main:
    print(json.dumps({"last": history[-1], "whole_val_top1": hits / len(val),
                      "tensorflow_imported": "tensorflow" in sys.modules,
                      "history": [r["val_top1"] for r in history]}), flush=True)
