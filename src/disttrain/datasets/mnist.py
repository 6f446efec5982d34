"""MNIST: a reader for the real IDX files, and a generated stand-in for when there are none.

Both give the same thing: a :class:`DigitsDataset` of ``1x28x28`` float32 images normalised
the way the "Mastering PyTorch" chapter does (``(x/255 - 0.1302) / 0.3069``) and int64
labels, so a training script cannot tell them apart. The generated images
(:func:`synthetic_digits`) are rendered from hand-drawn glyphs, 60,000 in about a second.

The IDX format (http://yann.lecun.com/exdb/mnist/) is a 4-byte big-endian magic number
``0x000008NN`` (``08``: unsigned bytes, ``NN``: number of dimensions), one big-endian
uint32 per dimension, then the data, row-major.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

__all__ = [
    "MEAN",
    "STD",
    "SPLITS",
    "DigitsDataset",
    "generate_digits",
    "load_mnist",
    "normalize",
    "read_idx",
    "read_mnist",
    "synthetic_digits",
    "write_idx",
    "write_mnist",
]

# The chapter's normalisation constants (its ``transforms.Normalize((0.1302,), (0.3069,))``).
MEAN = 0.1302
STD = 0.3069

IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions: count, rows, cols
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension: count
_UBYTE = 0x08
IMAGE_SIZE = (28, 28)

# split -> (images file, labels file), the names LeCun's site and torchvision use.
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# --------------------------------------------------------------------------- IDX files


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def read_idx(path: str | os.PathLike, *, magic: int | None = None) -> torch.Tensor:
    """Read one IDX file of unsigned bytes (plain, or gzip when the name ends in ``.gz``).

    ``magic``, when given, is the magic number the file must have (``0x00000803`` for
    images, ``0x00000801`` for labels). Returns a uint8 tensor of the header's shape.
    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file for
    anything malformed: bad magic, a header or body shorter (or longer) than declared, a
    corrupt gzip stream.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file {str(path)!r} does not exist")
    try:
        with _open(path) as f:
            data = f.read()
    except (EOFError, OSError) as err:  # truncated or corrupt gzip stream
        raise ValueError(f"IDX file {str(path)!r} cannot be decompressed: {err}") from err

    if len(data) < 4:
        raise ValueError(f"IDX file {str(path)!r} is truncated: {len(data)} bytes, no header")
    (found,) = struct.unpack(">I", data[:4])
    if magic is not None and found != magic:
        raise ValueError(
            f"IDX file {str(path)!r} has bad magic number 0x{found:08x}, expected 0x{magic:08x}"
            " (is it the right file, or still compressed without a .gz name?)"
        )
    if found >> 16 != 0 or (found >> 8) & 0xFF != _UBYTE or found & 0xFF == 0:
        raise ValueError(
            f"IDX file {str(path)!r} has bad magic number 0x{found:08x}:"
            " not an IDX file of unsigned bytes"
        )
    ndim = found & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(
            f"IDX file {str(path)!r} is truncated: header needs {header} bytes, file has {len(data)}"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(shape)
    body = len(data) - header
    if body != expected:
        what = "truncated" if body < expected else "longer than its header says"
        raise ValueError(
            f"IDX file {str(path)!r} is {what}: header says shape {tuple(shape)}"
            f" = {expected} bytes of data, file has {body}"
        )
    # frombuffer keeps the bytearray alive; bytearray (not bytes) because torch wants it writable.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header).reshape(shape)


def write_idx(path: str | os.PathLike, tensor: torch.Tensor) -> Path:
    """Write a uint8 tensor as an IDX file, gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    if tensor.dtype != torch.uint8:
        raise ValueError(
            f"write_idx writes uint8 tensors only, got {tensor.dtype} for {str(path)!r}"
        )
    if not 1 <= tensor.dim() <= 255:
        raise ValueError(
            f"write_idx needs 1 to 255 dimensions, got {tensor.dim()} for {str(path)!r}"
        )
    header = struct.pack(f">I{tensor.dim()}I", (_UBYTE << 8) | tensor.dim(), *tensor.shape)
    payload = header + tensor.contiguous().numpy().tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        # No name and mtime=0 in the gzip header: the same tensor always gives the same bytes.
        with open(path, "wb") as raw:
            with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
                f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def _find(root: Path, name: str) -> Path:
    """The file ``name`` in ``root``, plain or ``.gz``.

    Also looks in ``root/MNIST/raw`` (where torchvision downloads to) and accepts the
    ``train-images.idx3-ubyte`` spelling that some mirrors use.
    """
    dotted = name.replace("-idx", ".idx")
    candidates = [
        d / n
        for d in (root, root / "MNIST" / "raw")
        for n in (name, name + ".gz", dotted, dotted + ".gz")
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"MNIST file {name!r} (or {name}.gz) not found in {str(root)!r}"
        + ("" if root.is_dir() else f": {str(root)!r} is not a directory")
    )


def read_mnist(root: str | os.PathLike, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Read one split (``"train"`` or ``"test"``) of MNIST-format IDX files in ``root``.

    Returns ``(images, labels)``: uint8 tensors of shape ``(N, 28, 28)`` and ``(N,)``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    root = Path(root).expanduser()
    images_name, labels_name = SPLITS[split]
    images_path, labels_path = _find(root, images_name), _find(root, labels_name)
    images = read_idx(images_path, magic=IMAGES_MAGIC)
    labels = read_idx(labels_path, magic=LABELS_MAGIC)
    if tuple(images.shape[1:]) != IMAGE_SIZE:
        raise ValueError(
            f"IDX file {str(images_path)!r} holds {images.shape[1]}x{images.shape[2]} images,"
            f" MNIST images are {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}"
        )
    if len(images) != len(labels):
        raise ValueError(
            f"MNIST {split} split in {str(root)!r} does not match: {images_path.name!r} has"
            f" {len(images)} images but {labels_path.name!r} has {len(labels)} labels"
        )
    if len(labels) and int(labels.max()) > 9:
        raise ValueError(
            f"IDX file {str(labels_path)!r} has label {int(labels.max())}, expected 0..9"
        )
    return images, labels


def write_mnist(
    root: str | os.PathLike,
    split: str,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    compress: bool = False,
) -> tuple[Path, Path]:
    """Write ``(images, labels)`` as the split's two IDX files in ``root`` (``.gz`` if ``compress``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
        raise ValueError(
            f"write_mnist needs images (N, H, W) and labels (N,), got {tuple(images.shape)}"
            f" and {tuple(labels.shape)}"
        )
    suffix = ".gz" if compress else ""
    images_name, labels_name = SPLITS[split]
    root = Path(root)
    return (
        write_idx(root / (images_name + suffix), images.to(torch.uint8)),
        write_idx(root / (labels_name + suffix), labels.to(torch.uint8)),
    )


# --------------------------------------------------------------------------- the Dataset


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(N, H, W)`` -> float32 ``(N, 1, H, W)``, scaled to [0, 1] then standardised."""
    # (x/255 - MEAN)/STD as one scale and one shift, in place: two passes over 47M floats, not four
    return images.to(torch.float32).mul_(1 / (255 * STD)).sub_(MEAN / STD).unsqueeze(1)


class DigitsDataset(TensorDataset):
    """A ``TensorDataset`` of normalised ``1x28x28`` float32 images and int64 labels.

    Normalised once up front (188 MB for 60,000 images) rather than per item as the
    chapter's torchvision transforms do, so ``__getitem__`` is two indexing operations.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.dim() != 3:
            raise ValueError(
                f"images must be uint8 (N, H, W), got {images.dtype} {tuple(images.shape)}"
            )
        if labels.dim() != 1 or len(labels) != len(images):
            raise ValueError(f"labels must be ({len(images)},), got {tuple(labels.shape)}")
        super().__init__(normalize(images), labels.to(torch.int64))

    @property
    def images(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def targets(self) -> torch.Tensor:
        return self.tensors[1]


def load_mnist(root: str | os.PathLike, split: str = "train") -> DigitsDataset:
    """The real MNIST ``split`` (``"train"``: 60,000 images, ``"test"``: 10,000) from ``root``."""
    return DigitsDataset(*read_mnist(root, split))


# --------------------------------------------------------------------------- generated digits
#
# Each digit is one or more hand-drawn glyphs: polylines in a unit box (x right, y down),
# turned once into distance fields. Every generated image samples its glyph's distance
# field through its own random affine map plus a smooth random warp (grid_sample), then
# thresholds the distance at its own stroke thickness, and gets its own contrast and noise.
# All per-image work is batched tensor ops; the Python loops are over glyphs, not images.

_TEMPLATE = 56  # distance-field resolution: 2x the image, over the same extent
# Images are made this many at a time. A constant, not a parameter: the noise is drawn per
# chunk, so a different chunk size would give different images for the same seed.
_CHUNK = 4096


def _arc(cx: float, cy: float, rx: float, ry: float, start: float, end: float, n: int = 16):
    """Points on an ellipse from ``start`` to ``end`` degrees (0: right, 90: down)."""
    return [
        (cx + rx * math.cos(math.radians(a)), cy + ry * math.sin(math.radians(a)))
        for a in (start + (end - start) * i / (n - 1) for i in range(n))
    ]


def _glyphs() -> dict[int, list[list[list[tuple[float, float]]]]]:
    """digit -> its variants; a variant is a list of strokes; a stroke a list of points."""
    return {
        0: [[_arc(0.5, 0.5, 0.3, 0.48, 0, 360, 28)], [_arc(0.5, 0.5, 0.25, 0.48, -80, 290, 28)]],
        1: [
            [[(0.52, 0.0), (0.48, 1.0)]],
            [[(0.3, 0.22), (0.52, 0.0), (0.52, 1.0)], [(0.32, 1.0), (0.72, 1.0)]],
        ],
        2: [
            [_arc(0.5, 0.28, 0.3, 0.28, 190, 370) + [(0.2, 1.0), (0.82, 1.0)]],
            [_arc(0.48, 0.3, 0.3, 0.3, 200, 390) + [(0.18, 1.0), (0.5, 0.92), (0.85, 0.98)]],
        ],
        3: [
            [_arc(0.48, 0.26, 0.28, 0.26, -160, 90), _arc(0.48, 0.74, 0.32, 0.26, -90, 160)],
            [[(0.2, 0.0), (0.78, 0.0), (0.45, 0.42)], _arc(0.47, 0.7, 0.32, 0.3, -100, 160)],
        ],
        4: [
            [[(0.66, 1.0), (0.66, 0.0), (0.15, 0.66), (0.88, 0.66)]],
            [[(0.25, 0.0), (0.2, 0.6), (0.85, 0.6)], [(0.66, 0.15), (0.66, 1.0)]],
        ],
        5: [
            [[(0.78, 0.0), (0.3, 0.0), (0.26, 0.44)] + _arc(0.48, 0.68, 0.32, 0.3, -130, 150)],
            [
                [(0.3, 0.02), (0.26, 0.44)] + _arc(0.48, 0.68, 0.32, 0.3, -130, 150),
                [(0.3, 0.02), (0.8, 0.0)],
            ],
        ],
        6: [
            [
                _arc(0.72, 0.62, 0.5, 0.62, -95, -180, 10)
                + _arc(0.5, 0.72, 0.28, 0.28, 180, 540, 28)
            ],
            [[(0.68, 0.0), (0.25, 0.6)] + _arc(0.5, 0.74, 0.27, 0.26, 200, 560, 28)],
        ],
        7: [
            [[(0.18, 0.0), (0.82, 0.0), (0.4, 1.0)]],
            [[(0.18, 0.05), (0.82, 0.0), (0.45, 1.0)], [(0.35, 0.52), (0.78, 0.5)]],
        ],
        8: [
            [_arc(0.5, 0.25, 0.24, 0.25, 0, 360, 24), _arc(0.5, 0.74, 0.3, 0.26, 0, 360, 24)],
            [_arc(0.5, 0.25, 0.26, 0.24, 90, 450, 24), _arc(0.48, 0.73, 0.27, 0.27, -90, 270, 24)],
        ],
        9: [
            [_arc(0.5, 0.3, 0.28, 0.3, 0, 360, 28), [(0.78, 0.3), (0.72, 1.0)]],
            [_arc(0.48, 0.28, 0.28, 0.28, 0, 360, 28), _arc(0.26, 0.3, 0.52, 0.7, 0, 100, 10)],
        ],
    }


@lru_cache(maxsize=1)
def _distance_fields() -> tuple[torch.Tensor, torch.Tensor]:
    """``(fields, digit_of)``: one distance field ``(G, 1, 56, 56)`` per glyph, in image pixels.

    The unit glyph box maps onto the central 20x20 pixels of the 28x28 image, like MNIST's
    digits (size-normalised to 20x20, then centred).
    """
    fields, digit_of = [], []
    ys, xs = torch.meshgrid(torch.arange(_TEMPLATE), torch.arange(_TEMPLATE), indexing="ij")
    # template pixel centre -> image pixel coordinates (28x28 image space)
    pix = torch.stack([xs, ys], -1).reshape(-1, 1, 2).to(torch.float64).add(0.5).mul(28 / _TEMPLATE)
    for digit, variants in _glyphs().items():
        for strokes in variants:
            segs = []
            for stroke in strokes:
                p = torch.tensor(stroke, dtype=torch.float64) * 20 + 4  # unit box -> pixels 4..24
                segs.append(torch.stack([p[:-1], p[1:]], 1))
            seg = torch.cat(segs)  # (S, 2 ends, 2 coords)
            a, b = seg[:, 0], seg[:, 1]
            ab = b - a
            t = ((pix - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-12)
            nearest = a + t.clamp(0, 1).unsqueeze(-1) * ab
            dist = (pix - nearest).norm(dim=-1).min(dim=1).values
            fields.append(dist.reshape(1, _TEMPLATE, _TEMPLATE))
            digit_of.append(digit)
    return torch.stack(fields).to(torch.float32), torch.tensor(digit_of)


def _uniform(gen: torch.Generator, n: int, low: float, high: float) -> torch.Tensor:
    return torch.rand(n, generator=gen) * (high - low) + low


_WARP = 4  # the smooth warp is a _WARP x _WARP grid of random offsets, upsampled bicubically

# How much generated images vary, per image, uniformly in these ranges (tuned so the
# chapter's ConvNet is well above chance after ~25 steps, but not at 100%).
_ROTATE_DEG = 7.0  # +- rotation
_SHEAR = 0.15  # +- horizontal shear (slant)
_SCALE = (0.92, 1.07)  # size
_ASPECT = (0.92, 1.08)  # width / height
_SHIFT_PX = 1.3  # +- translation
_WARP_PX = 0.5  # standard deviation of the smooth warp's offsets
_HALF_WIDTH_PX = (0.9, 2.0)  # stroke half-width
_CONTRAST = (0.75, 1.0)  # ink intensity
_NOISE = 0.08  # upper bound of the per-image noise standard deviation
# Some images have a rectangle of their ink erased: a tail of hard, sometimes ambiguous,
# samples that keeps a trained model short of 100% (as MNIST's few illegible digits do).
_ERASE_PROB = 0.25
_ERASE_PX = (5, 11)  # side lengths of the erased rectangle


@lru_cache(maxsize=1)
def _grid_basis() -> torch.Tensor:
    """``(2 * (3 + _WARP**2), 28 * 28 * 2)``: sampling grids are a linear map of these.

    For each output pixel the grid point is ``theta @ (x, y, 1)`` plus a smooth warp; both
    are linear in per-image coefficients, so one matmul turns all the coefficients into
    ``affine_grid``'s layout ``(N, 28, 28, 2)`` -- much faster than ``affine_grid`` plus
    an ``interpolate`` per image.
    """
    centres = (torch.arange(28, dtype=torch.float32) * 2 + 1) / 28 - 1  # align_corners=False
    ys, xs = torch.meshgrid(centres, centres, indexing="ij")
    impulses = torch.eye(_WARP * _WARP).reshape(-1, 1, _WARP, _WARP)
    warp = F.interpolate(impulses, size=(28, 28), mode="bicubic", align_corners=True)
    per_axis = torch.cat(
        [xs.reshape(1, -1), ys.reshape(1, -1), torch.ones(1, 784), warp.reshape(-1, 784)]
    )
    basis = torch.zeros(2, len(per_axis), 784, 2)
    basis[0, :, :, 0] = per_axis  # coefficients of the grid's x
    basis[1, :, :, 1] = per_axis  # coefficients of the grid's y
    return basis.reshape(2 * len(per_axis), 784 * 2)


def synthetic_digits(n: int, *, seed: int) -> DigitsDataset:
    """``n`` generated 28x28 images of the digits 0-9, classes balanced to within one.

    A learnable, download-free stand-in for MNIST: the chapter's ConvNet gets well above
    chance within a few dozen steps but not to 100% at once, because every image varies
    in glyph, position, size, slant, rotation, stroke thickness, smooth warping, contrast
    and noise, and a quarter have part of their ink erased. The same ``(n, seed)`` gives
    the same dataset in every process without communicating: all randomness comes from one
    seeded generator, drawn in a fixed order (the labels are exact; pixels are computed by
    the same float ops, bit-identical on one machine whatever the thread count).
    """
    return DigitsDataset(*generate_digits(n, seed=seed))


def generate_digits(n: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw images behind :func:`synthetic_digits`: uint8 ``(n, 28, 28)``, int64 ``(n,)``.

    In the real files' format, so :func:`write_mnist` can turn them into an MNIST directory.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    gen = torch.Generator().manual_seed(seed)
    fields, digit_of = _distance_fields()

    labels = (torch.arange(n) % 10)[torch.randperm(n, generator=gen)]
    # a glyph of the right digit for every image
    per_digit = torch.bincount(digit_of, minlength=10)
    first = torch.cumsum(per_digit, 0) - per_digit
    glyph = first[labels] + (torch.rand(n, generator=gen) * per_digit[labels]).long()

    # Affine map from output to template coordinates (both normalised to [-1, 1]).
    # Dividing by the scale makes a bigger digit; the translation is in pixels / 14.
    angle = torch.deg2rad(_uniform(gen, n, -_ROTATE_DEG, _ROTATE_DEG))
    shear = _uniform(gen, n, -_SHEAR, _SHEAR)
    scale = _uniform(gen, n, *_SCALE)
    aspect = _uniform(gen, n, *_ASPECT)
    shift = (torch.rand(n, 2, generator=gen) * 2 - 1) * (_SHIFT_PX / 14)
    sx, sy = 1 / (scale * aspect), 1 / scale
    cos, sin = torch.cos(angle), torch.sin(angle)
    warp = torch.randn(n, 2, _WARP * _WARP, generator=gen) * (_WARP_PX / 14)
    coeffs = torch.cat(
        [
            torch.stack([cos * sx, (cos * shear - sin) * sy, shift[:, 0]], -1),
            warp[:, 0],
            torch.stack([sin * sx, (sin * shear + cos) * sy, shift[:, 1]], -1),
            warp[:, 1],
        ],
        1,
    )
    # stroke half-width in pixels, + 1/2 px for the anti-aliased edge
    thickness = _uniform(gen, n, *_HALF_WIDTH_PX) + 0.5
    contrast = _uniform(gen, n, *_CONTRAST) * 255
    noise_level = _uniform(gen, n, 0, _NOISE) * 255
    erase = torch.rand(n, generator=gen) < _ERASE_PROB
    erase_size = _uniform(gen, 2 * n, *_ERASE_PX).view(n, 2)
    erase_lo = _uniform(gen, 2 * n, 6, 22).view(n, 2) - erase_size / 2  # centre in pixels 6..22
    erase_hi = torch.where(erase[:, None], erase_lo + erase_size, erase_lo)  # empty if not erased

    # Render glyph by glyph (every image of a glyph samples the same distance field), in
    # slices of at most _CHUNK images, writing each slice to its images' places.
    order = torch.argsort(glyph, stable=True)
    counts = torch.bincount(glyph, minlength=len(fields)).tolist()
    basis = _grid_basis()
    pixel = torch.arange(28, dtype=torch.float32) + 0.5  # pixel centres
    images = torch.empty(n, 28, 28, dtype=torch.uint8)
    start = 0
    for k, count in enumerate(counts):
        for lo in range(start, start + count, _CHUNK):
            idx = order[lo : min(lo + _CHUNK, start + count)]
            m = len(idx)
            grid = (coeffs[idx] @ basis).view(m, 28, 28, 2)
            field = fields[k : k + 1].expand(m, -1, -1, -1)
            dist = F.grid_sample(field, grid, padding_mode="border", align_corners=False)
            dist = dist.view(m, 28, 28)
            # ink: the image's contrast (0..255) inside the stroke, 0 outside, a 1 px ramp between
            ink = (
                torch.sub(thickness[idx, None, None], dist)
                .clamp_(0, 1)
                .mul_(contrast[idx, None, None])
            )
            e_lo, e_hi = erase_lo[idx], erase_hi[idx]
            inside_x = (pixel >= e_lo[:, 0, None]) & (pixel < e_hi[:, 0, None])  # (m, 28)
            inside_y = (pixel >= e_lo[:, 1, None]) & (pixel < e_hi[:, 1, None])
            ink.masked_fill_(inside_y[:, :, None] & inside_x[:, None, :], 0)
            noise = torch.randn(m, 28, 28, generator=gen)
            images[idx] = (
                ink.addcmul_(noise, noise_level[idx, None, None]).clamp_(0, 255).to(torch.uint8)
            )
        start += count
    return images, labels
