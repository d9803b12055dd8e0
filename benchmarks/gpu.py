"""The core loop on a CUDA GPU: prefill and decode speed of an episode cache vs full KV, and peak GPU memory.

    HF_HUB_OFFLINE=1 python benchmarks/gpu.py [--model default|DIR] [--dtype bfloat16] [--out PATH]

For a history of 8K tokens and one as long as the model's window allows (window minus the room for a question
and answer; the same length for the 8K-window default model), block prefill (block 512) builds
- an epicache cache (budget 1024 per layer and KV head, patched-prompt scoring), and
- full KV (nothing evicted),
and times the prefill (history tokens/s, after an untimed warm-up prefill of each) and a forced greedy decode
of 64 tokens on top of each through `kvchat.model.llm.generate`, as `kvchat ask` answers (tokens/s, EOS ignored, after a
warm-up), with kvchat's decode step launching each kernel by itself and replayed as one CUDA graph (its default
there), with CUDA synchronised around every timing.
Peak GPU memory is torch.cuda.max_memory_allocated over each prefill + decode, reset in between
(the model's weights included).
Decode attention runs on flashinfer when the extra is installed (reported; the step is then never graphed), else
torch SDPA.

A session with a lent GPU runs it in one command through the `device` tool (the working tree is copied there):
    pip install -e '.[flashinfer]' 2>/dev/null; HF_HUB_OFFLINE=1 python benchmarks/gpu.py --out $OUT/gpu.md
That tool carries at most 64 MiB, less than the embedded model's weights: `--model DIR` takes a model dir with
the same config and random weights (speed and memory do not depend on the weights' values).
Without CUDA it exits 2 with one line. Prints a markdown table (stdout and --out).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _load import Load, checked  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu.md"
BUDGET, BLOCK, DECODE_TOKENS, SHORT = 1024, 512, 64, 8192


@dataclass(frozen=True)
class Row:
    history_tokens: int
    method: str
    entries: int           # most entries one layer holds after the prefill
    prefill_tokens_per_s: float
    decode_tokens_per_s: float          # kvchat's decode step, each kernel launched by itself
    graph_decode_tokens_per_s: float    # the same step replayed as one CUDA graph (kvchat.model.cuda_graph_step)
    peak_gib: float


def _timed(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    clock = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - clock


def _decode(lm, cache, prompt: torch.Tensor, tokens: int) -> float:
    """Seconds for `tokens` forced greedy steps on top of `cache` through `model.llm.generate`, the path `kvchat ask`
    answers by (its decode step where it applies), from the question's logits on (the question's prefill untimed)."""
    from kvchat.model.llm import generate

    mark = cache.checkpoint()
    started: list[float] = []

    def first_logits(_logits: torch.Tensor) -> None:
        torch.cuda.synchronize()
        started.append(time.perf_counter())

    try:
        with torch.inference_mode():
            for _ in generate(lm, cache, prompt, tokens + 1, first_logits, stop_ids=()):  # N+1 tokens: N steps
                pass
        torch.cuda.synchronize()
        return time.perf_counter() - started[0]
    finally:
        cache.rollback(mark)


def run(lm, lengths: list[int]) -> list[Row]:
    from core_loop import DECODE_QUESTION, long_history_ids, patched_prompt_ids  # benchmarks/ is on sys.path

    from kvchat.config import SYSTEM_PROMPT
    from kvchat.kv.budgets import uniform_budgets
    from kvchat.kv.prefill import block_prefill
    from kvchat.kv.scoring import PatchedPromptScorer
    from kvchat.model.llm import ChatLayout

    if lm.decode_step is None:
        raise SystemExit(f"{lm.spec}: kvchat's decode step does not apply to this model")
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)
    history = long_history_ids(lm, max(lengths)).to(lm.device)
    scorer = PatchedPromptScorer(patched_prompt_ids(lm, layout).to(lm.device))
    prompt = lm.encode(layout.question(DECODE_QUESTION))
    rows = []

    def prefill(context: torch.Tensor, budgets: list[int] | None):
        with torch.inference_mode():
            return block_prefill(lm.model, prefix, context, block_size=BLOCK, budgets=budgets,
                                 scorer=scorer if budgets else None)  # fmt: skip

    for method_budgets in (uniform_budgets(lm.num_layers, BUDGET), None):  # warm-up: kernels, cuDNN plans
        prefill(history[:, : 3 * BUDGET], method_budgets)
    for n in lengths:
        for method in ("epicache", "full"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            budgets = uniform_budgets(lm.num_layers, BUDGET) if method == "epicache" else None
            result, seconds = _timed(lambda: prefill(history[:, :n], budgets))  # noqa: B023 (called at once)
            cache = result.cache
            decode = {}
            for graphs in (False, True):
                lm.decode_step.cuda_graphs = graphs
                _decode(lm, cache, prompt, DECODE_TOKENS)  # warm-up (kernels, flashinfer's JIT, the graph's record)
                decode[graphs] = DECODE_TOKENS / _decode(lm, cache, prompt, DECODE_TOKENS)
            rows.append(Row(n, method, max(cache.sizes), n / seconds, decode[False], decode[True],
                            torch.cuda.max_memory_allocated() / 2**30))  # fmt: skip
            print(f"{n} tokens {method}: {rows[-1]}", file=sys.stderr)
            del cache, result
    return rows


def render(rows: list[Row], lm, backend: str, load: Load) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "## Core loop on CUDA (benchmarks/gpu.py)",
        "",
        f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, model {lm.spec} in "
        f"{str(lm.dtype).removeprefix('torch.')}, decode attention: {backend}; budget {BUDGET}, block {BLOCK}, "
        f"{DECODE_TOKENS} decoded tokens; run {load}. Peak GPU memory: torch.cuda.max_memory_allocated over "
        f"prefill + decode.",
        "",
        "| history tokens | cache | entries/layer | prefill tokens/s | decode tokens/s | with CUDA graphs | "
        "peak GPU GiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.history_tokens} | {r.method} | {r.entries} | {r.prefill_tokens_per_s:.0f} | "
              f"{r.decode_tokens_per_s:.1f} | {r.graph_decode_tokens_per_s:.1f} | {r.peak_gib:.2f} |"
              for r in rows]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default', a model dir or a .gguf file")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--models-dir", type=Path, default=None, help="where a GGUF is converted (default: home)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"markdown output (default {DEFAULT_OUT})")
    args = checked(parser, argv, skip=lambda _: not torch.cuda.is_available())  # without CUDA: the line below
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA GPU and torch {torch.__version__} sees none; run it where one is "
              "lent (see the module docstring)", file=sys.stderr)
        sys.exit(2)
    from kvchat.config import ANSWER_ROOM, DeviceConfig, default_home
    from kvchat.model.device import resolve
    from kvchat.model.llm import load_model

    lm = load_model(args.model, args.models_dir or default_home() / "models",
                    placement=resolve(DeviceConfig("cuda", args.dtype)))
    window = lm.context_window - ANSWER_ROOM if lm.context_window else SHORT
    lengths = sorted({min(SHORT, window), window})
    text = render(run(lm, lengths), lm, lm.attention_backend, args.load)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
