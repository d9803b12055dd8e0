"""Where a model runs and in which dtype: `--device auto|cpu|cuda` and `--dtype auto|float32|bfloat16|float16`
resolved once, here, into a `Placement` every command loads its model with.

`auto`: CUDA in bfloat16 when torch sees a GPU, else the CPU in float32. float16 on the CPU is refused: torch's
CPU kernels for half precision are slow and several (softmax over long rows, matmul accumulation) lose
accuracy, so an answer would be both slower and different from float32's; bfloat16 is the CPU's reduced dtype.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from kvchat.config import DEVICES, DTYPES, DeviceConfig
from kvchat.errors import UserError
from kvchat.messages import option

_log = logging.getLogger(__name__)  # `kvchat --debug` shows its records

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """A resolved device and dtype."""

    device: torch.device
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"{self.device.type} {self.dtype_name}"


CPU_FLOAT32 = Placement(torch.device("cpu"), torch.float32)  # the library's default: what kvchat always ran in


def resolve(config: DeviceConfig = DeviceConfig(), *, cuda_available: bool | None = None) -> Placement:
    """`config`'s device and dtype made concrete; a request this machine cannot honour is a UserError.
    `cuda_available` (default: torch.cuda.is_available()) lets tests resolve as on a GPU machine."""
    if config.device not in DEVICES:
        raise UserError(f"unknown {option('device')} {config.device!r} (choose from {', '.join(DEVICES)})")
    if config.dtype not in DTYPES:
        raise UserError(f"unknown {option('dtype')} {config.dtype!r} (choose from {', '.join(DTYPES)})")
    cuda, why = cuda_status() if cuda_available is None else (cuda_available, None)
    if config.device == "cuda" and not cuda:
        raise UserError(f"{option('device', 'cuda')}: torch sees no CUDA GPU here (torch "
                        f"{torch.__version__}{f': {why}' if why else ''}); use {option('device', 'cpu')} or auto")
    device = "cuda" if config.device == "cuda" or (config.device == "auto" and cuda) else "cpu"
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if device == "cpu" and dtype == "float16":
        raise UserError(f"{option('dtype', 'float16')} is not supported on the CPU (slow, inexact kernels); "
                        "use bfloat16 or float32 there")
    return Placement(torch.device(device), _DTYPES[dtype])


def cuda_status() -> tuple[bool, str | None]:
    """Whether torch sees a CUDA GPU, and why not when its initialisation failed: torch says so in a Python
    warning, which would reach the terminal as a traceback-like line; kvchat logs it (`--debug`) instead and names
    it when `--device cuda` is refused."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    why = next((str(w.message).strip().splitlines()[0] for w in caught if "CUDA" in str(w.message)), None)
    if why:
        _log.debug("torch: %s", why)
    return available, why

