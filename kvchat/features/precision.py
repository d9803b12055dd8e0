"""Cache precision (`--cache-precision int8|int4`): a finished episode cache is held, stored and answered from
in 8 or 4 bits (KIVI: keys per channel, values per token, in groups with a scale and minimum; kvchat.kv.quantize).

Quantizing is the last step of an episode's build: every layer becomes a `QuantizedLayer` (kvchat.kv.layers),
whose file layout the codec writes (kvchat.kv.codec: `precision` in the metadata gives the bits back). Each
precision has its own group size setting; an append dequantizes a stored cache, continues it in full
precision and quantizes it again here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.errors import UserError
from kvchat.features.feature import EpisodePart, EpisodeSetup, Feature
from kvchat.kv.config import CacheConfig
from kvchat.messages import setting

if TYPE_CHECKING:
    from kvchat.kv.cache import EpisodeCache


class Precision(Feature):
    """`--cache-precision NAME`: codes of `bits` bits, keys grouped by the CacheConfig field `group`."""

    def __init__(self, name: str, bits: int, group: str) -> None:
        self.name, self.bits, self.group = name, bits, group

    def active(self, cache: CacheConfig) -> bool:
        return cache.precision == self.name

    def validate(self, cache: CacheConfig) -> None:
        """No offload (its group size and residual: by their rows in kvchat.settings_table)."""
        if self.active(cache) and cache.offload.enabled:
            raise UserError(f"{setting('cache_precision', cache.precision)} does not combine with "
                            f"{setting('offload', cache.offload.mode)} "
                            "(its pages are stored at half precision and attached to full-precision layers); "
                            "choose one")  # fmt: skip

    def episode(self, setup: EpisodeSetup) -> EpisodePart:
        return _Quantize(self, setup.config)


class _Quantize(EpisodePart):
    def __init__(self, precision: Precision, config: CacheConfig) -> None:
        self.precision, self.config = precision, config

    def finish(self, cache: EpisodeCache, *, evicted: bool) -> None:
        cache.quantize(getattr(self.config, self.precision.group), self.config.quant_residual, self.precision.bits)
