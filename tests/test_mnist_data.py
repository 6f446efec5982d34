"""The MNIST IDX reader/writer and the generated digits."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import pytest
import torch

from disttrain.datasets import (
    DigitsDataset,
    generate_digits,
    load_mnist,
    read_idx,
    read_mnist,
    synthetic_digits,
    write_idx,
    write_mnist,
)
from disttrain.datasets import mnist as M


def small_split(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
    return images, labels


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_round_trip_both_splits(tmp_path: Path, compress: bool) -> None:
    train, test = small_split(12, seed=1), small_split(5, seed=2)
    write_mnist(tmp_path, "train", *train, compress=compress)
    write_mnist(tmp_path, "test", *test, compress=compress)
    suffix = ".gz" if compress else ""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        name + suffix for pair in M.SPLITS.values() for name in pair
    )
    for split, (images, labels) in (("train", train), ("test", test)):
        got_images, got_labels = read_mnist(tmp_path, split)
        assert got_images.dtype == got_labels.dtype == torch.uint8
        assert torch.equal(got_images, images) and torch.equal(got_labels, labels)


def test_header_is_big_endian_idx(tmp_path: Path) -> None:
    images, labels = small_split(3)
    images_path, labels_path = write_mnist(tmp_path, "train", images, labels)
    raw = images_path.read_bytes()
    assert struct.unpack(">4I", raw[:16]) == (0x00000803, 3, 28, 28)
    assert raw[16:] == images.numpy().tobytes()
    assert struct.unpack(">2I", labels_path.read_bytes()[:8]) == (0x00000801, 3)


def test_gz_output_is_reproducible(tmp_path: Path) -> None:
    images, _ = small_split(4)
    a = write_idx(tmp_path / "a.gz", images).read_bytes()
    b = write_idx(tmp_path / "b.gz", images).read_bytes()
    assert a == b  # no timestamp in the gzip header
    assert gzip.decompress(a)[:4] == b"\x00\x00\x08\x03"


def test_plain_file_preferred_and_gz_found(tmp_path: Path) -> None:
    plain, packed = small_split(4, seed=1), small_split(4, seed=2)
    write_mnist(tmp_path, "train", *packed, compress=True)
    assert torch.equal(read_mnist(tmp_path, "train")[0], packed[0])
    write_mnist(tmp_path, "train", *plain)
    assert torch.equal(read_mnist(tmp_path, "train")[0], plain[0])


def test_torchvision_layout_is_found(tmp_path: Path) -> None:
    images, labels = small_split(4)
    write_mnist(tmp_path / "MNIST" / "raw", "test", images, labels, compress=True)
    assert torch.equal(read_mnist(tmp_path, "test")[1], labels)


def test_dataset_normalisation_and_types(tmp_path: Path) -> None:
    images = torch.tensor([[[0, 255] * 14] * 28], dtype=torch.uint8)
    labels = torch.tensor([7], dtype=torch.uint8)
    write_mnist(tmp_path, "train", images, labels)
    ds = load_mnist(tmp_path, "train")
    x, y = ds[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and int(y) == 7
    expected = (images.float() / 255 - 0.1302) / 0.3069
    assert torch.allclose(x, expected, atol=1e-6)


# --------------------------------------------------------------------------- bad files


def test_missing_file_names_it(tmp_path: Path) -> None:
    images, labels = small_split(4)
    write_mnist(tmp_path, "train", images, labels)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        read_mnist(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        read_mnist(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_mnist(tmp_path / "nowhere", "train")
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        read_idx(tmp_path / "nope.idx")


def test_bad_magic_names_file_and_numbers(tmp_path: Path) -> None:
    images, labels = small_split(4)
    images_path, labels_path = write_mnist(tmp_path, "train", images, labels)
    # labels where images belong: a valid IDX file with the wrong magic
    images_path.write_bytes(labels_path.read_bytes())
    with pytest.raises(
        ValueError, match=r"train-images-idx3-ubyte.*0x00000801.*expected 0x00000803"
    ):
        read_mnist(tmp_path, "train")


def test_not_an_idx_file(tmp_path: Path) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ValueError, match=r"junk.*bad magic number 0x504b0304"):
        read_idx(path)


def test_compressed_file_without_gz_name(tmp_path: Path) -> None:
    images, _ = small_split(2)
    packed = write_idx(tmp_path / "x.gz", images)
    packed.rename(tmp_path / "train-images-idx3-ubyte")
    with pytest.raises(ValueError, match="bad magic.*still compressed"):
        read_idx(tmp_path / "train-images-idx3-ubyte", magic=0x00000803)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_truncated_data(tmp_path: Path, compress: bool) -> None:
    images, labels = small_split(4)
    payload = write_idx(tmp_path / "full", images).read_bytes()[:-10]
    name = "train-images-idx3-ubyte" + (".gz" if compress else "")
    (tmp_path / name).write_bytes(gzip.compress(payload) if compress else payload)
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    with pytest.raises(
        ValueError, match=rf"{name}.*truncated.*\(4, 28, 28\) = 3136 bytes.*has 3126"
    ):
        read_mnist(tmp_path, "train")


def test_truncated_header(tmp_path: Path) -> None:
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x08\x01\x00\x00")
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.*truncated: header needs 8 bytes"):
        read_idx(path)
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.*truncated"):
        read_idx(path)


def test_cut_off_gzip_stream(tmp_path: Path) -> None:
    images, _ = small_split(4)
    path = write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz.*cannot be decompressed"):
        read_idx(path)


def test_trailing_bytes(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "labels", torch.arange(5, dtype=torch.uint8))
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(ValueError, match="labels.*longer than its header says"):
        read_idx(path)


def test_count_mismatch_names_both_files(tmp_path: Path) -> None:
    images, labels = small_split(6)
    write_mnist(tmp_path, "test", images, labels)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:5])
    with pytest.raises(
        ValueError,
        match=r"'t10k-images-idx3-ubyte' has 6 images but 't10k-labels-idx1-ubyte' has 5",
    ):
        read_mnist(tmp_path, "test")


def test_wrong_image_size_and_label_range(tmp_path: Path) -> None:
    write_mnist(
        tmp_path,
        "train",
        torch.zeros(2, 32, 32, dtype=torch.uint8),
        torch.zeros(2, dtype=torch.uint8),
    )
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.*32x32 images"):
        read_mnist(tmp_path, "train")
    write_mnist(
        tmp_path,
        "test",
        torch.zeros(2, 28, 28, dtype=torch.uint8),
        torch.tensor([3, 10], dtype=torch.uint8),
    )
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.*label 10"):
        read_mnist(tmp_path, "test")


def test_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        read_mnist(tmp_path, "validation")
    with pytest.raises(ValueError, match="uint8"):
        write_idx(tmp_path / "f", torch.zeros(3))
    with pytest.raises(ValueError, match="uint8"):
        DigitsDataset(torch.zeros(2, 28, 28), torch.zeros(2))


# --------------------------------------------------------------------------- generated digits


def test_synthetic_shapes_types_and_range() -> None:
    ds = synthetic_digits(250, seed=3)
    assert isinstance(ds, DigitsDataset) and len(ds) == 250
    assert ds.images.shape == (250, 1, 28, 28) and ds.images.dtype == torch.float32
    assert ds.targets.shape == (250,) and ds.targets.dtype == torch.int64
    assert int(ds.targets.min()) >= 0 and int(ds.targets.max()) <= 9
    # Normalised from uint8 pixels: exactly the 256 levels of the real data.
    pixels = ds.images * 0.3069 + 0.1302
    assert float(pixels.min()) > -1e-5 and float(pixels.max()) < 1 + 1e-5
    assert torch.allclose(pixels * 255, (pixels * 255).round(), atol=1e-3)
    # Dark background, bright strokes, like MNIST (whose mean pixel is about 0.13).
    assert 0.05 < float(pixels.mean()) < 0.3
    x, y = ds[0]
    assert x.shape == (1, 28, 28) and y.dim() == 0


def test_synthetic_deterministic_per_seed() -> None:
    a, b = synthetic_digits(300, seed=7), synthetic_digits(300, seed=7)
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    c = synthetic_digits(300, seed=8)
    assert not torch.equal(a.images, c.images)


def test_synthetic_deterministic_across_thread_counts() -> None:
    """Ranks may run with different OMP_NUM_THREADS; the data must not depend on it."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = synthetic_digits(5000, seed=11)
        torch.set_num_threads(2)
        two = synthetic_digits(5000, seed=11)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.images, two.images) and torch.equal(one.targets, two.targets)


def test_synthetic_classes_balanced() -> None:
    counts = torch.bincount(synthetic_digits(1003, seed=0).targets, minlength=10)
    assert counts.max() - counts.min() <= 1 and int(counts.sum()) == 1003


def test_synthetic_images_differ_within_a_class() -> None:
    ds = synthetic_digits(200, seed=0)
    ones = ds.images[ds.targets == 1]
    assert len(ones) == 20
    assert len({img.numpy().tobytes() for img in ones}) == len(ones)


def test_synthetic_classes_are_distinguishable() -> None:
    """A nearest-class-mean classifier, fitted in a blink, is far above chance (10%)."""
    train, val = synthetic_digits(2000, seed=0), synthetic_digits(500, seed=1)
    means = torch.stack([train.images[train.targets == d].mean(0) for d in range(10)]).flatten(1)
    predicted = torch.cdist(val.images.flatten(1), means).argmin(1)
    accuracy = float((predicted == val.targets).float().mean())
    assert accuracy > 0.5


def test_synthetic_edge_sizes() -> None:
    assert len(synthetic_digits(0, seed=0)) == 0
    assert len(synthetic_digits(1, seed=0)) == 1
    with pytest.raises(ValueError, match="n must be >= 0"):
        synthetic_digits(-1, seed=0)


def test_generated_digits_round_trip_through_idx(tmp_path: Path) -> None:
    """Generated digits are in the real files' format: written and read back, same dataset."""
    images, labels = generate_digits(40, seed=5)
    assert images.dtype == torch.uint8 and images.shape == (40, 28, 28)
    write_mnist(tmp_path, "train", images, labels, compress=True)
    back, direct = load_mnist(tmp_path, "train"), synthetic_digits(40, seed=5)
    assert torch.equal(back.images, direct.images) and torch.equal(back.targets, direct.targets)
