"""STL-10: a reader and writer for the binary release, and a generated stand-in.

The AWS tutorial trains ResNet-18 on STL-10 through ``torchvision.datasets.STL10``; this
reads the same files without torchvision. The binary release
(https://cs.stanford.edu/~acoates/stl10/, ``stl10_binary.tar.gz``) holds

- ``train_X.bin`` / ``test_X.bin``: uint8 images of 3x96x96, one after another, each
  channel by channel (red, green, blue) and each channel **column-major** -- the layout of
  the MATLAB arrays it was made from. Read as ``(N, 3, 96, 96)`` an image comes out
  transposed, hence the ``transpose(2, 3)``;
- ``train_y.bin`` / ``test_y.bin``: one uint8 label per image, **1 to 10**;
- ``class_names.txt``: the ten names, one a line (``airplane`` ... ``truck``).

In memory, as torchvision has it: images uint8 ``(N, 3, 96, 96)`` (row-major, CHW) and
labels 0..9. :func:`generate_stl10` makes images of the same shape whose classes a small
network can tell apart in a few steps, so the example runs without the 2.6 GB download.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = [
    "CLASS_NAMES",
    "IMAGE_SHAPE",
    "SPLITS",
    "STL10Dataset",
    "generate_stl10",
    "load_stl10",
    "read_stl10",
    "write_stl10",
]

IMAGE_SHAPE = (3, 96, 96)
_IMAGE_BYTES = math.prod(IMAGE_SHAPE)  # 27,648
CLASS_NAMES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")
# split -> (images file, labels file), the release's names
SPLITS = {"train": ("train_X.bin", "train_y.bin"), "test": ("test_X.bin", "test_y.bin")}
# The tutorial's transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)): [0, 1] -> [-1, 1]
MEAN = 0.5
STD = 0.5


def _find(root: Path, name: str) -> Path:
    """``root/name``, or ``root/stl10_binary/name`` (the archive's folder, torchvision's layout)."""
    for candidate in (root / name, root / "stl10_binary" / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"STL-10 file {name!r} not found in {str(root)!r} (nor in its stl10_binary folder)"
        + ("" if root.is_dir() else f": {str(root)!r} is not a directory")
    )


def read_stl10(root: str | os.PathLike, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Read one split (``"train"``: 5,000 images, ``"test"``: 8,000) from ``root``.

    Returns ``(images, labels)``: uint8 ``(N, 3, 96, 96)`` and int64 ``(N,)`` in 0..9.
    Raises ``FileNotFoundError`` naming a missing file and ``ValueError`` naming the file
    for one of the wrong size or with a label outside 1..10.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    root = Path(root).expanduser()
    images_path, labels_path = (_find(root, name) for name in SPLITS[split])
    raw = images_path.read_bytes()
    if len(raw) % _IMAGE_BYTES:
        raise ValueError(
            f"STL-10 file {str(images_path)!r} has {len(raw)} bytes, not a whole number of "
            f"3x96x96 images ({_IMAGE_BYTES} bytes each): truncated, or not an STL-10 image file"
        )
    labels_raw = labels_path.read_bytes()
    count = len(raw) // _IMAGE_BYTES
    if len(labels_raw) != count:
        raise ValueError(
            f"STL-10 {split} split in {str(root)!r} does not match: {images_path.name!r} has "
            f"{count} images but {labels_path.name!r} has {len(labels_raw)} labels"
        )
    # bytearray, not bytes: torch wants a writable buffer
    images = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, *IMAGE_SHAPE)
    labels = torch.frombuffer(bytearray(labels_raw), dtype=torch.uint8).to(torch.int64)
    if count and (int(labels.min()) < 1 or int(labels.max()) > 10):
        bad = int(labels.min()) if int(labels.min()) < 1 else int(labels.max())
        raise ValueError(f"STL-10 file {str(labels_path)!r} has label {bad}, expected 1..10")
    # column-major channels -> (N, 3, H, W) as every torch model expects
    return images.transpose(2, 3).contiguous(), labels - 1


def write_stl10(root: str | os.PathLike, split: str, images: torch.Tensor,
                labels: torch.Tensor) -> tuple[Path, Path]:
    """Write ``(images, labels)`` (uint8 ``(N, 3, 96, 96)``, labels 0..9) as the split's
    two files in ``root``, in the release's layout, plus ``class_names.txt``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if images.dtype != torch.uint8 or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(f"write_stl10 needs uint8 images (N, 3, 96, 96), got {images.dtype} "
                         f"{tuple(images.shape)}")
    if labels.dim() != 1 or len(labels) != len(images):
        raise ValueError(f"write_stl10 needs labels ({len(images)},), got {tuple(labels.shape)}")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) > 9):
        raise ValueError("write_stl10 needs labels in 0..9 (they are written as 1..10)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    images_path, labels_path = (root / name for name in SPLITS[split])
    images_path.write_bytes(images.transpose(2, 3).contiguous().numpy().tobytes())
    labels_path.write_bytes((labels + 1).to(torch.uint8).numpy().tobytes())
    (root / "class_names.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    return images_path, labels_path


class STL10Dataset(Dataset):
    """uint8 ``(N, 3, 96, 96)`` images served as float32 ``(3, S, S)`` in [-1, 1], and labels.

    Resized per item (bilinear, antialiased, like ``transforms.Resize``), because the
    tutorial's 224x224 floats for 5,000 images would take 3 GB up front; at 96 nothing
    is resized.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, image_size: int = 96) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (N, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        if labels.dim() != 1 or len(labels) != len(images):
            raise ValueError(f"labels must be ({len(images)},), got {tuple(labels.shape)}")
        if image_size < 1:
            raise ValueError(f"image_size must be at least 1, got {image_size}")
        self.images = images
        self.targets = labels.to(torch.int64)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index].to(torch.float32).div_(255)
        if image.shape[-1] != self.image_size or image.shape[-2] != self.image_size:
            image = F.interpolate(image.unsqueeze(0), size=(self.image_size, self.image_size),
                                  mode="bilinear", antialias=True, align_corners=False).squeeze(0)
        return image.sub_(MEAN).div_(STD), self.targets[index]


def load_stl10(root: str | os.PathLike, split: str = "train", *, image_size: int = 96) -> STL10Dataset:
    """The real STL-10 ``split`` from ``root``, served at ``image_size``."""
    return STL10Dataset(*read_stl10(root, split), image_size=image_size)


def generate_stl10(n: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` generated STL-shaped images (uint8 ``(n, 3, 96, 96)``) and labels 0..9.

    Each class is a colour and a stripe orientation; every image varies both (hue,
    brightness, stripe frequency and phase), adds a random blob and noise, so a network
    must look at colour and texture, at any size it is resized to. Classes are balanced
    to within one; the same ``(n, seed)`` gives the same images in every process.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.arange(n) % 10)[torch.randperm(n, generator=gen)]
    size = IMAGE_SHAPE[1]
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    # class -> base colour (hue around the wheel) and stripe angle (18 degrees apart)
    hue = labels.to(torch.float32) / 10 + (torch.rand(n, generator=gen) - 0.5) * 0.06
    angle = labels.to(torch.float32) * (math.pi / 10) + (torch.rand(n, generator=gen) - 0.5) * 0.15
    freq = 3 + torch.rand(n, generator=gen) * 3
    phase = torch.rand(n, generator=gen) * 2 * math.pi
    bright = 0.35 + torch.rand(n, generator=gen) * 0.3
    along = xs * torch.cos(angle)[:, None, None] + ys * torch.sin(angle)[:, None, None]
    stripes = torch.sin(along * freq[:, None, None] * math.pi + phase[:, None, None])  # (n, H, W)
    channel = torch.arange(3, dtype=torch.float32)
    colour = 0.5 + 0.5 * torch.cos(2 * math.pi * (hue[:, None] - channel / 3))  # (n, 3)
    images = bright[:, None, None, None] + 0.25 * colour[:, :, None, None] * stripes[:, None]
    images = images + 0.25 * (colour[:, :, None, None] - 0.5)
    # a blob somewhere, of a random colour: clutter that carries no class
    centre = torch.rand(n, 2, generator=gen) * 1.6 - 0.8
    radius = 0.15 + torch.rand(n, generator=gen) * 0.25
    blob = ((xs - centre[:, 0, None, None]) ** 2 + (ys - centre[:, 1, None, None]) ** 2
            < radius[:, None, None] ** 2)
    images = torch.where(blob[:, None], torch.rand(n, 3, 1, 1, generator=gen), images)
    images = images + torch.randn(n, 3, size, size, generator=gen) * 0.06
    return images.clamp_(0, 1).mul_(255).round_().to(torch.uint8), labels
