"""One decode query's attention on the CPU: kvchat's grouped matmuls (`softmax_attention`) against torch's SDPA.

    HF_HUB_OFFLINE=1 python benchmarks/decode_attention.py [--threads 1 2] [--out PATH]

The embedded model's shape (9 query heads over 3 KV heads of 64 dimensions; float32, and bfloat16 as a
`--dtype bfloat16` model holds its cache), 30 layers of distinct
random keys and values per length so a step reads them from memory as a decode step does; microseconds per
layer, best of 5 repeats of 20 passes. What `kvchat.kv.attention.SDPA_DECODE_ENTRIES` is chosen from.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _load import checked  # benchmarks/ is on sys.path

from kvchat.kv.attention import softmax_attention

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "decode_attention.md"


def per_layer_us(attention, queries, keys, values) -> float:
    best = float("inf")
    for _ in range(5):
        clock = time.perf_counter()
        for _ in range(20):
            for q, k, v in zip(queries, keys, values, strict=True):
                attention(q, k, v)
        best = min(best, (time.perf_counter() - clock) / (20 * LAYERS))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = checked(parser)
    grouped = lambda q, k, v: softmax_attention(q, k, v, DIM**-0.5)  # noqa: E731
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, enable_gqa=True)  # noqa: E731
    lines = [
        f"### One decode query's attention, microseconds per layer ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {dt.date.today()}; `{Path(__file__).name}`; run {args.load})", "",
        "| dtype | threads | entries per head | grouped matmuls | SDPA | SDPA / grouped |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for threads in args.threads:
            torch.set_num_threads(threads)
            for n in LENGTHS:
                queries = [torch.randn(1, HEADS, 1, DIM, dtype=dtype) for _ in range(LAYERS)]
                keys = [torch.randn(1, KV_HEADS, n, DIM, dtype=dtype) for _ in range(LAYERS)]
                values = [torch.randn(1, KV_HEADS, n, DIM, dtype=dtype) for _ in range(LAYERS)]
                a, b = per_layer_us(grouped, queries, keys, values), per_layer_us(sdpa, queries, keys, values)
                lines.append(f"| {str(dtype).removeprefix('torch.')} | {threads} | {n} | {a:.1f} | {b:.1f} | "
                             f"{b / a:.2f} |")
                print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
