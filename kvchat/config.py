"""Every tunable default of kvchat, in one place. The CLI and the library both start from these."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

# epicache: episodic patched prompts; the rest are query-agnostic baselines adapted to block prefill
# (EpiCache A.2) that build a single cache: streaming, snapkv, infinipot, kvzip, keydiff; full keeps all.
METHODS = ("epicache", "full", "streaming", "snapkv", "infinipot", "kvzip", "keydiff")
LAYER_BUDGETS = ("auto", "uniform", "sensitivity", "pyramid")
POSITION_MODES = ("original", "compact", "auto")
HEAD_BUDGETS = ("uniform", "adaptive")
# Methods whose scores are attention weights, comparable across the heads of a layer: the ones that
# head-wise (adaptive) selection applies to. Streaming ranks by recency, the same in every head.
HEAD_ADAPTIVE_METHODS = ("epicache", "snapkv", "infinipot", "kvzip")
# Adaptive head budgets: every KV head keeps at least this fraction of its layer's per-head budget M_l
# (AdaKV's safeguard alpha = 0.2), and never less than the protected system prompt, so a head whose
# attention is focused is not starved to nothing by heads that spread theirs.
HEAD_FLOOR_FRACTION = 0.2

# EpiCache's official instruction for the patched prompt (METHODS.md, point 3).
EPISODE_INSTRUCTION = (
    "Extract essential information from this conversation segment. Identify speaker names, "
    "personas, key events with dates/times, personal details, commitments, opinions, relationships, "
    "emotional moments, and unique experiences."
)

INFINIPOT_PROMPT = "Summarize the previous context highlighting the most important parts."
KVZIP_PROMPT = "Repeat the part of the previous context exactly."
SNAPKV_WINDOW = 64        # SnapKV's observation window: the block's last tokens
STREAMING_SINK = 128      # StreamingLLM sink tokens, scaled down to budget // 4 for small budgets

# The conversation sits in the system turn, the question in a user turn: SmolLM2 answers
# planted-fact questions far better this way than with both in one user message (DESIGN.md).
SYSTEM_PROMPT = (
    "You are a helpful assistant with a memory of a past conversation. Answer the user's question "
    "briefly, using only facts from the conversation below.\n\nConversation:\n"
)


def default_home() -> Path:
    """$KVCHAT_HOME, else the platform's user data dir."""
    env = os.environ.get("KVCHAT_HOME")
    return Path(env) if env else Path(platformdirs.user_data_dir("kvchat", appauthor=False))


@dataclass(frozen=True)
class EpisodeConfig:
    """How a history is cut into topical episodes (EpiCache §3.1)."""

    episodes: int = 4          # E: number of K-Means clusters (capped at the number of segments)
    window: int = 4            # w: turns per segment
    prompt_tokens: int = 256   # cap on an episode's patched prompt (instruction + medoid segments)
    seed: int = 0              # K-Means seed, so the same history gives the same episodes


@dataclass(frozen=True)
class CacheConfig:
    """How one episode's compressed cache is built by block prefill."""

    method: str = "epicache"   # "epicache" (patched-prompt scoring) or "full" (keep everything)
    budget: int = 1024         # M: kept KV entries per layer and KV head, system prompt included
    block_size: int = 512      # B: tokens fed per block before evicting back to M
    positions: str = "auto"    # original | compact | auto (compact only when the history exceeds the window)
    pool_kernel: int = 7       # max-pool of scores over neighbouring tokens (SnapKV practice); 1 = off
    layer_budgets: str = "auto"  # auto (sensitivity when the model has a profile, else uniform) | uniform |
                                 # sensitivity | pyramid
    alpha: float | None = None   # sharpness of sensitivity budgets; None = the profile's suggestion
    head_budgets: str = "uniform"  # uniform (M_l entries in every KV head) | adaptive (AdaKV: the layer's
                                   # top M_l x kv_heads (head, token) pairs, floor HEAD_FLOOR_FRACTION x M_l)


@dataclass(frozen=True)
class IngestConfig:
    model: str = "default"
    episodes: EpisodeConfig = EpisodeConfig()
    cache: CacheConfig = CacheConfig()
    system_prompt: str = SYSTEM_PROMPT
    instruction: str = EPISODE_INSTRUCTION


@dataclass(frozen=True)
class AskConfig:
    max_new_tokens: int = 64


@dataclass(frozen=True)
class ProfileSettings:
    """Layer-sensitivity calibration (`kvchat profile-layers`, EpiCache §3.2)."""

    budget: int = 512            # simulated cache size M
    block_size: int = 256        # simulated prefill block B
    sink: int = 128              # leading tokens always visible (StreamingLLM sink)
    max_tokens: int = 3072       # the calibration text is cut to this many tokens
    suggested_alpha: float = 1.2  # EpiCache uses 1.1-1.3 for the LLaMA family
