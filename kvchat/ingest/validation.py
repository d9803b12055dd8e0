"""Setting values that cannot work, refused before a model or torch is loaded (an ingest's first step).

Each value is checked against its row in kvchat.settings_table (choices, bounds), then the combinations and ranges
a row does not say. Nothing here imports torch: `kvchat ingest` refuses a bad value in a fraction of a second.
"""

from __future__ import annotations

from kvchat import features, settings_table
from kvchat.config import IngestConfig
from kvchat.errors import UserError
from kvchat.kv.methods import across_heads_methods, candidates
from kvchat.settings_table import given, named


def validate(config: IngestConfig) -> None:
    """Reject setting values that cannot work, before anything is loaded or written: each against its row in
    kvchat.settings_table (choices, bounds), then the combinations and ranges a row does not say."""
    cache = config.cache
    settings_table.check(config)
    if cache.block_size > cache.budget * 8 and cache.method != "full":
        raise UserError(
            f"{given('block_size', cache.block_size)} is more than 8x {given('budget', cache.budget)}: "
            "peak memory would be dominated by the block"
        )
    if cache.head_budgets == "adaptive" and not all(e.across_heads for e in candidates(cache.method)):
        raise UserError(
            f"{given('head_budgets', 'adaptive')} needs attention scores to compare across heads; "
            f"{given('method', cache.method)} has none (use it with {', '.join(across_heads_methods())})"
        )
    if cache.alpha is not None and not 0 < cache.alpha <= 10:
        raise UserError(f"{named('alpha')} must be in (0, 10] (got {cache.alpha})")
    for key in ("pool_kernel", "indexer_pool_kernel", "cake_pool_kernel"):
        kernel = settings_table.setting(key).get(config)
        if kernel < 1 or kernel % 2 == 0:
            raise UserError(f"{named(key)} must be an odd number >= 1 (got {kernel})")
    cake = cache.cake
    for key, tau in (("tau1", cake.tau1), ("tau2", cake.tau2)):
        if not 0 < tau <= 10:  # also refuses nan and inf
            raise UserError(f"{named(key)} must be in (0, 10] (got {tau})")
    if not cake.gamma < float("inf"):
        raise UserError(f"{named('cake_gamma')} must be finite (got {cake.gamma})")
    features.validate(cache)
