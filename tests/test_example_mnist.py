"""examples/mnist_convnet.py end to end: one process, real-format files, two processes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from _launch import run_ranks, run_single
from disttrain.datasets import generate_digits, write_mnist

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist_convnet.py"
SUMMARY_KEYS = {
    "world_size",
    "epochs",
    "train_samples_per_s",
    "epoch_seconds",
    "train_loss",
    "val_accuracy",
}


def rank_lines(stdout: str, rank: int) -> list[str]:
    """Lines of one rank: ``disttrain run`` prefixes them with ``[rankN] ``; a world of one doesn't."""
    prefix = f"[rank{rank}] "
    lines = stdout.strip().splitlines()
    if not any(line.startswith("[rank") for line in lines):
        return lines
    return [line[len(prefix):] for line in lines if line.startswith(prefix)]


def summary(result: subprocess.CompletedProcess) -> dict:
    """The JSON object on the last stdout line, after checking the run succeeded."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = rank_lines(result.stdout, 0)
    assert lines, f"no output\n{result.stderr}"
    report = json.loads(lines[-1])
    assert SUMMARY_KEYS <= report.keys()
    assert report["train_samples_per_s"] > 0 and all(s > 0 for s in report["epoch_seconds"])
    assert len(report["epoch_seconds"]) == report["epochs"]
    return report


def load_example():
    """The example as a module, for its ConvNet and argument parsing (main() does not run)."""
    spec = importlib.util.spec_from_file_location("mnist_convnet_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(150)
def test_one_process_learns_and_saves(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = summary(
        run_single(
            EXAMPLE, ["--samples", "3000", "--epochs", "1", "--output-dir", out], timeout=140
        )
    )
    assert report["world_size"] == 1 and report["epochs"] == 1
    assert report["train_samples"] == 3000 and report["val_samples"] == 500
    assert report["val_accuracy"] > 0.5  # chance is 0.1; typically 0.8-0.95
    assert 0 < report["train_loss"] < 2.3  # below ln(10): it learned something
    state = torch.load(out / "model.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state)  # saved unwrapped
    load_example().ConvNet().load_state_dict(state)  # strict: exactly the chapter's layers
    assert not list(out.glob("*.tmp"))


@pytest.mark.timeout(120)
def test_real_format_files(tmp_path: Path) -> None:
    data = tmp_path / "mnist"
    write_mnist(data, "train", *generate_digits(600, seed=1), compress=True)
    write_mnist(data, "test", *generate_digits(150, seed=2))  # plain files next to .gz ones
    result = run_single(
        EXAMPLE, ["--data", data, "--batch-size", "64", "--log-every", "0"], timeout=110
    )
    report = summary(result)
    assert report["train_samples"] == 600 and report["val_samples"] == 150
    assert "MNIST from" in result.stdout


def test_missing_data_dir_fails_naming_the_file(tmp_path: Path) -> None:
    example = load_example()
    args = example.get_args_parser().parse_args(["--data", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte.*not found in"):
        example.datasets(args)


@pytest.mark.parametrize(
    "flag, value", [("--epochs", "0"), ("--batch-size", "0"), ("--log-every", "-1")]
)
def test_bad_flags_are_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture) -> None:
    parser = load_example().get_args_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be at least" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 2,000 images: 1,000 per rank, 32 steps of 32 per rank; 333 validation images split 167 + 166.
    args = ["--samples", "2000", "--batch-size", "32", "--log-every", "10", "--output-dir", out]
    result = run_ranks(EXAMPLE, 2, args, timeout=170)
    report = summary(result)
    assert report["world_size"] == 2 and report["global_batch_size"] == 64
    assert report["val_samples"] == 333  # every validation image counted exactly once
    assert report["val_accuracy"] > 0.3  # chance is 0.1
    # Only rank 0 prints: one summary, one line per logged step.
    lines = result.stdout.strip().splitlines()
    assert not any(line.startswith("[rank1]") for line in lines)
    lines = rank_lines(result.stdout, 0)
    assert sum(line.startswith("{") for line in lines) == 1
    assert sum(line.startswith("epoch 0 step 0/") for line in lines) == 1
    load_example().ConvNet().load_state_dict(torch.load(out / "model.pt", weights_only=True))
