"""Datasets for the examples and tests: importing this package imports torch."""

from .mnist import (
    DigitsDataset,
    generate_digits,
    load_mnist,
    read_idx,
    read_mnist,
    synthetic_digits,
    write_idx,
    write_mnist,
)
from .stl10 import STL10Dataset, generate_stl10, load_stl10, read_stl10, write_stl10

__all__ = [
    "DigitsDataset",
    "generate_digits",
    "load_mnist",
    "read_idx",
    "read_mnist",
    "synthetic_digits",
    "write_idx",
    "write_mnist",
]
__all__ += ["STL10Dataset", "generate_stl10", "load_stl10", "read_stl10", "write_stl10"]
