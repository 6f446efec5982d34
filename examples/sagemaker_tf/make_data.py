"""A small toxic-comment dataset, generated (the seed article trains on Kaggle's Jigsaw data).

``train.csv`` and ``valid.csv`` with ``text,label`` rows: label 1 when a comment insults,
0 otherwise; sentences are drawn from word lists with a fixed seed, so every run is the same.
"""

from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

SUBJECTS = ["this post", "your answer", "the article", "that comment", "his reply", "the video", "your code"]
KIND = ["is really helpful", "made my day", "explains it well", "is a great read", "was thoughtful",
        "is clear and kind", "helped me a lot", "is well written"]
RUDE = ["is stupid garbage", "is an idiotic mess", "is dumb and worthless", "makes you look like a moron",
        "is pathetic trash", "is for idiots", "is total rubbish you fool", "is moronic nonsense"]
FILLER = ["honestly", "to be fair", "I think", "again", "as usual", "today", "frankly", "really"]


def sentence(rng: random.Random, toxic: bool) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(RUDE if toxic else KIND)]
    if rng.random() < 0.6:
        words.insert(rng.randrange(3), rng.choice(FILLER))
    return " ".join(words)


def make(folder: Path, n_train: int = 2048, n_valid: int = 256, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.csv", n_train), ("valid.csv", n_valid)):
        with open(folder / name, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["text", "label"])
            for _ in range(n):
                toxic = rng.random() < 0.5
                noisy = toxic if rng.random() > 0.03 else not toxic  # a few mislabelled rows, as real data has
                writer.writerow([sentence(rng, toxic), int(noisy)])
    return folder


if __name__ == "__main__":
    print(make(Path(sys.argv[1] if len(sys.argv) > 1 else "data")))
