"""The STL-10 binary reader/writer on generated files, and the generated images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain.datasets import STL10Dataset, generate_stl10, load_stl10, read_stl10, write_stl10
from disttrain.datasets import stl10 as S


def small_split(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 96, 96), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return images, labels


def test_round_trip_both_splits(tmp_path: Path) -> None:
    train, test = small_split(6, seed=1), small_split(3, seed=2)
    write_stl10(tmp_path, "train", *train)
    write_stl10(tmp_path, "test", *test)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "class_names.txt", "test_X.bin", "test_y.bin", "train_X.bin", "train_y.bin"]
    for split, (images, labels) in (("train", train), ("test", test)):
        got_images, got_labels = read_stl10(tmp_path, split)
        assert got_images.dtype == torch.uint8 and got_labels.dtype == torch.int64
        assert torch.equal(got_images, images) and torch.equal(got_labels, labels)
    assert (tmp_path / "class_names.txt").read_text().split() == list(S.CLASS_NAMES)


def test_the_release_layout_column_major_channels_and_labels_from_one(tmp_path: Path) -> None:
    """What the official files hold, written by hand: a pixel's place and a label's value."""
    image = torch.zeros(1, 3, 96, 96, dtype=torch.uint8)
    image[0, 1, 2, 5] = 200  # green channel, row 2, column 5
    write_stl10(tmp_path, "train", image, torch.tensor([9]))
    raw = (tmp_path / "train_X.bin").read_bytes()
    assert len(raw) == 3 * 96 * 96
    # channel 1 starts after one 96x96 plane; column-major: column 5's row 2 is 5 * 96 + 2 in
    assert raw.index(200) == 96 * 96 + 5 * 96 + 2
    assert (tmp_path / "train_y.bin").read_bytes() == bytes([10])  # labels are 1..10 on disk


def test_the_archives_folder_is_found(tmp_path: Path) -> None:
    images, labels = small_split(2)
    write_stl10(tmp_path / "stl10_binary", "test", images, labels)
    assert torch.equal(read_stl10(tmp_path, "test")[1], labels)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"STL-10 file 'train_X.bin' not found in"):
        read_stl10(tmp_path, "train")
    write_stl10(tmp_path, "train", *small_split(2))
    (tmp_path / "train_y.bin").unlink()
    with pytest.raises(FileNotFoundError, match="'train_y.bin' not found"):
        read_stl10(tmp_path, "train")


def test_truncated_images_file_is_named(tmp_path: Path) -> None:
    write_stl10(tmp_path, "train", *small_split(2))
    path = tmp_path / "train_X.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError) as err:
        read_stl10(tmp_path, "train")
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "55196 bytes, not a whole number of 3x96x96 images (27648 bytes each)" in message


def test_label_count_mismatch_names_both_files(tmp_path: Path) -> None:
    write_stl10(tmp_path, "test", *small_split(3))
    (tmp_path / "test_y.bin").write_bytes(bytes([1, 2]))
    with pytest.raises(ValueError, match="'test_X.bin' has 3 images but 'test_y.bin' has 2 labels"):
        read_stl10(tmp_path, "test")


@pytest.mark.parametrize("bad", [0, 11])
def test_label_out_of_range_is_named(tmp_path: Path, bad: int) -> None:
    write_stl10(tmp_path, "train", *small_split(2))
    (tmp_path / "train_y.bin").write_bytes(bytes([1, bad]))
    with pytest.raises(ValueError, match=rf"train_y.bin' has label {bad}, expected 1..10"):
        read_stl10(tmp_path, "train")


def test_writer_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    images, labels = small_split(2)
    with pytest.raises(ValueError, match=r"uint8 images \(N, 3, 96, 96\)"):
        write_stl10(tmp_path, "train", images[:, :, :32, :32], labels)
    with pytest.raises(ValueError, match="labels in 0..9"):
        write_stl10(tmp_path, "train", images, labels + 10)
    with pytest.raises(ValueError, match="split must be one of"):
        write_stl10(tmp_path, "unlabeled", images, labels)


def test_dataset_resizes_and_normalises(tmp_path: Path) -> None:
    write_stl10(tmp_path, "train", *small_split(3))
    full = load_stl10(tmp_path, "train")
    small = load_stl10(tmp_path, "train", image_size=32)
    image, label = full[1]
    assert image.shape == (3, 96, 96) and image.dtype == torch.float32 and label.dtype == torch.int64
    assert -1.0 <= float(image.min()) and float(image.max()) <= 1.0
    assert small[1][0].shape == (3, 32, 32) and len(small) == 3


def test_generated_images_are_balanced_reproducible_and_not_constant() -> None:
    images, labels = generate_stl10(40, seed=3)
    assert images.shape == (40, 3, 96, 96) and images.dtype == torch.uint8
    assert torch.bincount(labels, minlength=10).tolist() == [4] * 10
    again, _ = generate_stl10(40, seed=3)
    assert torch.equal(images, again)
    assert not torch.equal(images, generate_stl10(40, seed=4)[0])
    assert float(images.float().std()) > 20  # texture, not flat colour
    assert STL10Dataset(images, labels)[0][0].shape == (3, 96, 96)


def test_generated_classes_can_be_told_apart() -> None:
    """Even the crudest cue, an image's mean colour, beats chance (10%) by far: learnable."""
    images, labels = generate_stl10(400, seed=3)
    colour = images.float().mean((2, 3))
    centres = torch.stack([colour[labels == k].mean(0) for k in range(10)])
    test_images, test_labels = generate_stl10(200, seed=9)
    guess = torch.cdist(test_images.float().mean((2, 3)), centres).argmin(1)
    assert float((guess == test_labels).float().mean()) > 0.4
