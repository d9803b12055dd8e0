"""Which kernel runs decode attention (one query token over an episode cache), and running it.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/backends.py".
"""

from __future__ import annotations

import functools
import importlib.util

import torch

BACKENDS = ("torch", "flashinfer")
_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def flashinfer_installed() -> bool:
    """The `flashinfer` extra is importable (looked up once; importing it compiles nothing yet)."""
    return importlib.util.find_spec("flashinfer") is not None


def decode_backend(device: torch.device, dtype: torch.dtype) -> str:
    """`flashinfer` where it runs (CUDA, half precision, the extra installed), else `torch`."""
    return "flashinfer" if device.type == "cuda" and dtype in _HALF and flashinfer_installed() else "torch"


def flashinfer_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor | None:
    """Attention of one query token `[1, q_heads, 1, D]` over `key`/`value` `[1, kv_heads, n, D]` through
    flashinfer, shaped `[1, q_heads, 1, D]` as SDPA's output; None where flashinfer does not run (then the
    caller runs torch)."""
    if query.shape[2] != 1 or decode_backend(query.device, query.dtype) != "flashinfer" or key.dtype != query.dtype:
        return None
    import flashinfer

    group = query.shape[1] // key.shape[1]
    out = flashinfer.single_decode_with_kv_cache(
        query[0, :, 0].contiguous(), key[0].contiguous(), value[0].contiguous(), kv_layout="HND",
        use_tensor_cores=group not in (1, 2, 4), sm_scale=scale, logits_soft_cap=softcap,
    )  # [q_heads, D]
    return out.view(1, query.shape[1], 1, query.shape[-1])
