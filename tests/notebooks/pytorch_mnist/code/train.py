"""The get-started notebook's training script, shortened: MNIST from SM_CHANNEL_TRAINING/TESTING
(the .gz IDX files), a small ConvNet, a test pass, ``model.pth`` in SM_MODEL_DIR."""

import argparse
import gzip
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.view(-1, 320)))), dim=1)


def load(data_dir, train):
    prefix = "train" if train else "t10k"
    with gzip.open(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), "rb") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28).astype(np.float32)
    with gzip.open(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), "rb") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    images = (images - images.mean()) / (images.std() + 1e-8)
    return TensorDataset(torch.tensor(images), torch.tensor(labels))


def main(args):
    torch.manual_seed(args.seed)
    train_loader = DataLoader(load(args.train, True), batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(load(args.test, False), batch_size=args.test_batch_size)
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=args.learning_rate, betas=(args.beta_1, args.beta_2))
    print("Start training ...", flush=True)
    for epoch in range(1, args.epochs + 1):
        net.train()
        for batch_idx, (imgs, labels) in enumerate(train_loader, 1):
            loss = F.nll_loss(net(imgs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(imgs)}/{len(train_loader.dataset)}] Loss: {loss.item():.6f}")
        net.eval()
        correct, total_loss = 0, 0.0
        with torch.no_grad():
            for imgs, labels in test_loader:
                out = net(imgs)
                total_loss += F.nll_loss(out, labels, reduction="sum").item()
                correct += (out.argmax(1) == labels).sum().item()
        n = len(test_loader.dataset)
        print(f"Test set: Average loss: {total_loss / n:.4f}, Accuracy: {correct}/{n}", flush=True)
    print("Saving the model", flush=True)
    torch.save(net.state_dict(), os.path.join(args.model_dir, "model.pth"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--beta_1", type=float, default=0.9)
    parser.add_argument("--beta_2", type=float, default=0.999)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=100)
    # Container environment
    parser.add_argument("--hosts", type=list, default=json.loads(os.environ["SM_HOSTS"]))
    parser.add_argument("--current-host", type=str, default=os.environ["SM_CURRENT_HOST"])
    parser.add_argument("--model-dir", type=str, default=os.environ["SM_MODEL_DIR"])
    parser.add_argument("--train", type=str, default=os.environ["SM_CHANNEL_TRAINING"])
    parser.add_argument("--test", type=str, default=os.environ["SM_CHANNEL_TESTING"])
    parser.add_argument("--num-gpus", type=int, default=os.environ["SM_NUM_GPUS"])
    main(parser.parse_args())
