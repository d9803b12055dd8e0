"""Moving cached keys to new positions.

Cached keys already carry their RoPE rotation R(p). RoPE rotations compose, R(p') = R(p' - p) R(p), so
a key moves from p to p' by rotating it by the difference. We take cos/sin from the model's own rotary
module (so rope scaling variants give the right frequencies) and divide out its attention scaling,
which must be applied once, not once per move.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The second half of the last dimension, negated, then the first: RoPE's rotation by 90 degrees in each pair of
    channels, as transformers' Llama-family models pair them (kept here so answering never imports their code)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(
    keys: torch.Tensor, delta: torch.Tensor, rotary_emb: torch.nn.Module
) -> torch.Tensor:
    """Rotate `keys` [1, heads, n, dim] by per-entry position offsets `delta` [heads, n]."""
    cos, sin = rotary_emb(keys, position_ids=delta.to(torch.long))  # [heads, n, dim]
    scaling = getattr(rotary_emb, "attention_scaling", 1.0) or 1.0
    cos, sin = (cos / scaling).to(keys.dtype), (sin / scaling).to(keys.dtype)
    return keys * cos.unsqueeze(0) + rotate_half(keys) * sin.unsqueeze(0)


def reposition_keys(
    keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor, rotary_emb: torch.nn.Module
) -> torch.Tensor:
    """Keys rotated for positions `old` [heads, n] re-rotated as if computed at positions `new`."""
    return rotate_keys(keys, new - old, rotary_emb)
