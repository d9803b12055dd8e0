"""Which model families kvchat's attention answers correctly with, and the one line that refuses the rest.

kvchat replaces a model's attention function (kvchat.kv.attention) and keeps a subset of the history's
entries at their RoPE positions; a family it cannot answer correctly with is refused, never approximated.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/families.py".
"""

from __future__ import annotations

from kvchat.errors import UserError
from kvchat.messages import setting


def sliding_window(config) -> int | None:
    """The smallest attention window of the model's sliding-window layers; None when every layer is global."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if layer_types is None and getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def check_supported(model, spec: str) -> None:
    """Refuse, in one line, a loaded model whose attention kvchat cannot serve."""
    if not hasattr(model, "model") or not hasattr(model.model, "rotary_emb"):
        raise UserError(f"{spec}: kvchat supports decoder-only models with rotary position embeddings "
                        "(Llama, Qwen2/3, Mistral, Gemma2/3 families); this one has none")


def check_context(config, tokens: int, spec: str, *, what: str = "the history") -> None:
    """Refuse a context of `tokens` that a sliding-window layer of the model would not see whole."""
    window = sliding_window(config)
    if window is not None and tokens > window:
        raise UserError(
            f"{spec} has sliding-window attention layers of {window} tokens, and {what} needs {tokens}: kvchat "
            f"would let those layers see past their window; use a history of at most {window} tokens in all, or "
            "a model without sliding-window layers"
        )


def check_positions(config, positions: str, spec: str) -> None:
    """Compact positions re-rotate keys with one RoPE base; refuse them on sliding-window models."""
    if positions == "compact" and sliding_window(config) is not None:
        raise UserError(f"compact positions are not supported on {spec} (sliding-window layers); use "
                        f"{setting('positions', 'original')}")
