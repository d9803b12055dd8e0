"""KIVI-style quantization of cached keys and values in 8 or 4 bits (Liu et al. 2024, arXiv 2402.02750).

KIVI found that keys have a few channels with large magnitudes while values do not, so keys are quantized
**per channel** (a group of `group` consecutive tokens shares one scale and zero point per channel) and values
**per token** (a group of `group` consecutive channels of one token shares them). Both are asymmetric
(min-max): `code = round((x - min) / scale)`, `scale = (max - min) / L` with `L = 2^bits - 1` levels (255 or
15), and `x ~ code * scale + min`, so every number comes back within half a step, `scale / 2`, of what it was.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/quantize.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PRECISION_BITS = {"int8": 8, "int4": 4}  # --cache-precision -> bits per code (kvchat.config.CACHE_PRECISIONS)
SCALE_DTYPES = {8: torch.float32, 4: torch.float16}  # bits -> dtype of the stored scales and minima


def levels(bits: int) -> int:
    """The largest code: 255 for 8 bits, 15 for 4."""
    return 2**bits - 1


def value_group(group: int, head_dim: int) -> int:
    """Channels per value group: `group` when it divides `head_dim`, else the whole head."""
    return group if head_dim % group == 0 else head_dim


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[..., D]` (D even) two per byte `[..., D / 2]`: channel 2j low, 2j + 1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack4`."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _stored(x: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    """`x` (float32) in `dtype`, rounded toward `toward` (-inf: down, inf: up) rather than to the nearest; back
    as float32, the exact value that will be stored."""
    rounded = x.to(dtype)
    off = rounded.float() > x if toward < 0 else rounded.float() < x
    return torch.where(off, torch.nextafter(rounded, torch.full_like(rounded, toward)), rounded).float()


def quantize_along(x: torch.Tensor, dim: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of `x` in `bits` in groups spanning dimension `dim` (kept, size 1, in scale and
    min). Returns `(codes uint8 unpacked, scale, min)`, scale and min in `SCALE_DTYPES[bits]`; a constant group
    gets scale 1 and codes 0 (exact, where its value is representable)."""
    dtype, top = SCALE_DTYPES[bits], levels(bits)
    x = x.to(torch.float32)
    if x.numel() and not x.abs().amax() < torch.finfo(dtype).max:  # also refuses nan and inf
        raise ValueError(f"numbers beyond {torch.finfo(dtype).max:g} cannot be quantized in {bits} bits")
    low = _stored(x.amin(dim=dim, keepdim=True), dtype, -float("inf"))
    scale = (x.amax(dim=dim, keepdim=True) - low) / top
    scale = _stored(torch.where(scale > 0, scale, torch.ones_like(scale)), dtype, float("inf"))
    codes = ((x - low) / scale).round_().clamp_(0, top).to(torch.uint8)
    return codes, scale.to(dtype), low.to(dtype)


@dataclass(frozen=True)
class QuantizedEntries:
    """`n` entries of one KV head (`[n, D]`) or of every head of a uniform layer (`[kv_heads, n, D]`) in `bits`
    (8 or 4). Keys: codes `[..., n, D]`, scale and min `[..., n / group, D]`. Values: codes `[..., n, D]`, scale
    and min `[..., n, D / value_group]`. At 4 bits the codes are packed (`[..., n, D / 2]`, `pack4`). `dtype`:
    what dequantization gives back (the model's)."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor
    dtype: torch.dtype
    bits: int = 8

    @classmethod
    def quantize(cls, keys: torch.Tensor, values: torch.Tensor, group: int, bits: int = 8) -> QuantizedEntries:
        """`keys`/`values` `[..., n, D]` with `n` a multiple of `group` (and `D` even at 4 bits)."""
        *lead, n, dim = keys.shape
        if n % group:
            raise ValueError(f"{n} entries do not fill whole groups of {group}")
        vgroup = value_group(group, dim)
        kc, ks, km = quantize_along(keys.reshape(*lead, n // group, group, dim), dim=-2, bits=bits)
        vc, vs, vm = quantize_along(values.reshape(*lead, n, dim // vgroup, vgroup), dim=-1, bits=bits)
        kc, vc = kc.reshape(*lead, n, dim), vc.reshape(*lead, n, dim)
        if bits == 4:
            kc, vc = pack4(kc), pack4(vc)
        return cls(kc, ks.squeeze(-2), km.squeeze(-2), vc, vs.squeeze(-1), vm.squeeze(-1), keys.dtype, bits)

    @property
    def length(self) -> int:
        return self.key_codes.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """Of the keys (and values) these entries dequantize to: `[..., n, D]`."""
        return (*self.key_codes.shape[:-1], self.key_codes.shape[-1] * (8 // self.bits))

    def _codes(self, stored: torch.Tensor) -> torch.Tensor:
        return unpack4(stored) if self.bits == 4 else stored

    def keys_into(self, out: torch.Tensor) -> torch.Tensor:
        """Dequantized keys written into `out` (`[..., n, D]`, any strides along the leading axes): one
        multiply and one add over the whole tensor (float32 arithmetic), no loop over groups."""
        *lead, n, dim = out.shape
        groups = self.key_scale.shape[-2]
        if n:
            grouped = out.view(*lead, groups, n // groups, dim)
            codes = self._codes(self.key_codes).view(*lead, groups, n // groups, dim)
            torch.mul(codes, self.key_scale.float().unsqueeze(-2), out=grouped)
            grouped.add_(self.key_min.unsqueeze(-2))
        return out

    def values_into(self, out: torch.Tensor) -> torch.Tensor:
        """Dequantized values written into `out` (see `keys_into`)."""
        *lead, n, dim = out.shape
        groups = self.value_scale.shape[-1]
        if n:
            grouped = out.view(*lead, n, groups, dim // groups)
            codes = self._codes(self.value_codes).view(*lead, n, groups, dim // groups)
            torch.mul(codes, self.value_scale.float().unsqueeze(-1), out=grouped)
            grouped.add_(self.value_min.unsqueeze(-1))
        return out

    def keys(self) -> torch.Tensor:
        return self.keys_into(torch.empty(self.shape, dtype=self.dtype, device=self.key_codes.device))

    def values(self) -> torch.Tensor:
        return self.values_into(torch.empty(self.shape, dtype=self.dtype, device=self.value_codes.device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.key_codes, self.key_scale, self.key_min, self.value_codes, self.value_scale, self.value_min)

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor], dtype: torch.dtype, bits: int = 8) -> QuantizedEntries:
        """The inverse of `tensors()`: entries of these six tensors, in its order."""
        key_codes, key_scale, key_min, value_codes, value_scale, value_min = tensors
        return cls(key_codes, key_scale, key_min, value_codes, value_scale, value_min, dtype, bits)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def quantized_length(n: int, group: int, residual: int) -> int:
    """Entries of a head holding `n` that are quantized: all but the last `residual`, in whole key groups (the
    rest, fewer than `residual + group`, stays in full precision)."""
    return max(0, n - residual) // group * group
