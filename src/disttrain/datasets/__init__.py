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
