"""CI goes red when the venv is not what the README promises (a resolver once swapped in CUDA torch)."""

from install_check import problems


def test_venv_holds_the_pinned_cpu_torch_and_no_cuda_wheels():
    assert problems() == []
