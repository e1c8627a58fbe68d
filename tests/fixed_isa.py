"""One set of CPU kernels for every machine the tests run on, so that the pinned runs
(`tests/test_pinned_runs.py`) compute the same bits on an AVX2 and on an AVX-512 processor.

Float results on a CPU depend on which vector kernels run: PyTorch's own ops pick theirs by the
processor's instruction set (a wider vector sums in another order), and so do MKL's matrix
products and oneDNN's convolutions. Each reads an environment variable once, when torch loads, that
caps it at AVX2 (MKL_CBWR also makes MKL's results reproducible across processors). This module sets
them, unless already set, and must be imported before torch: `conftest.py` imports it first, and
`pinned_runs.py` before its own torch import, for `--record`.

The ISA cap is not enough for oneDNN: it also picks its convolution kernels' blocking from the
processor (cache sizes among others), so an AMD and an Intel processor sum a convolution in
different orders. The pinned runs therefore run inside `pinned_kernels()`: one thread, and oneDNN
off, so that convolutions go through ATen's own im2col and MKL's reproducible matrix product.
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

ISA = "AVX2"
ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}

if "torch" not in sys.modules:
    for _name, _value in ENVIRONMENT.items():
        os.environ.setdefault(_name, _value)


def fixed_isa_problem() -> str | None:
    """Why torch here does not run the kernels the pins were recorded with, or None."""
    import torch

    settings = {name: os.environ.get(name) for name in ENVIRONMENT}
    capability = torch.backends.cpu.get_cpu_capability()
    if settings != ENVIRONMENT or capability != ISA:
        return (
            f"pinned runs are recorded with {ENVIRONMENT} (CPU capability {ISA}); here {settings}, "
            f"capability {capability}: set these before torch is imported (tests/fixed_isa.py, "
            "imported first by conftest.py), on a processor with AVX2"
        )
    return None


@contextmanager
def pinned_kernels() -> Iterator[None]:
    """One thread and no oneDNN for the duration: the kernels every pinned run is recorded with."""
    import torch

    threads, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.backends.mkldnn.enabled = onednn
