"""Decode speed on the CPU: kvchat from an episode cache vs kvchat full KV vs llama.cpp, on one history.

    HF_HUB_OFFLINE=1 python benchmarks/decode_speed.py [--tokens 48] [--threads 2] [--out PATH]
    HF_HUB_OFFLINE=1 python benchmarks/decode_speed.py precision [--questions 12]

`speed` (the default): a LoCoMo conversation (conv-26 from ../shared/data) cut to 1K/2K/4K/~7.5K history tokens
(8K is the model's window: 7.5K leaves room for the question and answer), the embedded SmolLM2-135M:
- kvchat full KV: one full-KV prefill of the longest history; shorter ones are its first entries (causal
  attention: the same cache a shorter prefill builds);
- kvchat episode cache: `--prefill full`'s selection from that cache (EpiCache's patched prompt, budget 512
  per layer and KV head, uniform), in float32, with the model and cache in bfloat16, and with int8 and int4
  weights (`--weights int8|int4`);
- llama.cpp (llama-cpp-python, the extra `kvchat[bench]`, never imported by kvchat) over the same model's
  Q4_1 GGUF, and over each `--gguf` file (the same weights in other precisions, e.g. written by llama.cpp's
  `convert_hf_to_gguf.py --outtype f32|f16|q8_0` from kvchat's converted model directory), on the same token
  ids, with its defaults (f16 KV cache); skipped, with a line saying so, when it is not installed.
Every engine gets the same question's ids, then decodes `--tokens` greedy tokens (end of turn ignored);
tokens/s counts the steps after the first token, which every engine takes from its prompt pass.
The bandwidth limit of a row is the bytes a step must read (weights, lm_head included, plus the cache)
over the machine's copy bandwidth (2 x bytes of a 256 MiB `copy_` per second, on `--threads`).

`alternate`: the 1K question, measured as a user meets the two engines: kvchat's default on a CPU (the episode
cache, int4 weights) and llama.cpp (full KV, Q4_1) each in a fresh process of its own, taking turns `--runs`
times per length, `--reps` answers each after a warm-up; the ratio per run, its median and a bootstrap interval
of its mean. (In `speed` llama.cpp runs in the process that holds kvchat's four models, seconds after them.)

    HF_HUB_OFFLINE=1 python benchmarks/decode_speed.py alternate --lengths 1024 [--runs 10] [--reps 5]

`precision`: int8 and int4 weights (`--weights`, answering from the float cache) and bfloat16 (model and its
own cache) against float32 on the shared LoCoMo conversations (full KV at 4K tokens): first-answer-token
KL(fp32 || other) and agreement (token F1 between the two greedy answers), as `kvchat eval` measures a
method against full KV.

Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import EPISODE_INSTRUCTION, SYSTEM_PROMPT
from kvchat.eval.gold import bootstrap_interval
from kvchat.eval.qa import token_f1
from kvchat.history.loading import format_turns, load_history
from kvchat.kv.budgets import uniform_budgets
from kvchat.kv.cache import Checkpoint, EpisodeCache
from kvchat.kv.prefill import block_prefill, select_from
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.model.device import Placement
from kvchat.model.files import default_gguf_path
from kvchat.model.llm import ChatLayout, LoadedModel, generate, load_model, use_threads

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "locomo"
MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "decode_speed.md"
LENGTHS = (1024, 2048, 4096, 7600)
BUDGET = 512
BLOCK = 512
PROMPT_TOKENS = 256  # the patched prompt's segment, as EpisodeConfig.prompt_tokens
BFLOAT16 = Placement(torch.device("cpu"), torch.bfloat16)


def log(message: str) -> None:
    print(f"[decode_speed {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    prefix: torch.Tensor    # system prompt, [1, p]
    history: torch.Tensor   # the conversation, [1, n]
    question: torch.Tensor  # question turn, [1, q]
    patched: torch.Tensor   # the episode's patched prompt


def inputs(lm: LoadedModel, conversation: Path) -> Inputs:
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    turns = load_history(conversation)
    history = lm.encode("\n".join(format_turns(turns)))
    question = json.loads(conversation.read_text())["qa"][0]["question"]
    segment = lm.decode(history[0, : PROMPT_TOKENS - lm.encode(EPISODE_INSTRUCTION).shape[-1]].tolist())
    return Inputs(
        lm.encode(layout.before_conversation), history, lm.encode(layout.question(question)),
        lm.encode(layout.question(f"{EPISODE_INSTRUCTION}\n\n{segment}")),
    )


def full_cache(lm: LoadedModel, data: Inputs, n: int) -> EpisodeCache:
    """Full KV of the system prompt and the first `n` history tokens, by one prefill."""
    with torch.inference_mode():
        return block_prefill(lm.model, data.prefix, data.history[:, :n], block_size=BLOCK, budgets=None,
                             scorer=None).cache  # fmt: skip


def episode_cache(lm: LoadedModel, data: Inputs, full: EpisodeCache, n: int) -> tuple[EpisodeCache, EpisodeCache]:
    """Full KV at `n` history tokens (the first entries of `full`), and `--prefill full`'s episode cache selected
    from it (the patched prompt's scores, budget 512 uniform)."""
    whole = first_entries(full, data.prefix.shape[-1] + n)
    with torch.inference_mode():
        episode = select_from(lm.model, whole, data.history[:, n - BLOCK : n], budgets=uniform_budgets(
            lm.num_layers, BUDGET), scorer=PatchedPromptScorer(data.patched))  # fmt: skip
    return whole, episode


def first_entries(cache: EpisodeCache, n: int) -> EpisodeCache:
    """A copy of the full cache `cache` holding its first `n` entries (the cache of a prefill of those)."""
    short = cache.copy()
    short.rollback(Checkpoint(tuple(tuple(min(x, n) for x in layer.lengths) for layer in short.layers), n))
    return short


def in_dtype(cache: EpisodeCache, dtype: torch.dtype) -> EpisodeCache:
    """The same entries cast to `dtype` (for speed only: a cache the bf16 model built differs slightly)."""
    from kvchat.kv.cache import UniformLayer

    layers = [UniformLayer.of(layer.keys.to(dtype), layer.values.to(dtype), layer.positions) for layer in cache.layers]
    return EpisodeCache.of_layers(layers, next_position=cache.next_position, protected=cache.protected)


# --------------------------------------------------------------------------- engines


def kvchat_rate(lm: LoadedModel, cache: EpisodeCache, question: torch.Tensor, tokens: int) -> float:
    """Tokens/s of `llm.generate` (the product's loop) after its first token; the cache is rolled back."""
    mark = cache.checkpoint()
    try:
        steps = generate(lm, cache, question, tokens, stop_ids=())
        next(steps)  # the question's pass and the first token
        clock = time.perf_counter()
        n = sum(1 for _ in steps)
        return n / (time.perf_counter() - clock)
    finally:
        cache.rollback(mark)


class LlamaCpp:
    """llama.cpp over the GGUF, fed token ids; its KV cache keeps a prefix between measurements."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.weights = weight_type(gguf)
        self.llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        clock = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - clock)

    def rate(self, keep: int, question: list[int], tokens: int) -> float:
        """Keep the first `keep` cached tokens, feed `question`, decode `tokens` greedily; tokens/s after the first."""
        self.llm.n_tokens = keep  # eval() drops every cached entry from here on
        self.llm.eval(question)
        token = self.llm.sample(temp=0.0)
        clock = time.perf_counter()
        for _ in range(tokens - 1):
            self.llm.eval([token])
            token = self.llm.sample(temp=0.0)
        return (tokens - 1) / (time.perf_counter() - clock)


def weight_type(gguf: Path) -> str:
    """The GGUF's weight precision as llama.cpp names it (`general.file_type`: Q4_1, Q8_0, F16, F32...)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(gguf).fields["general.file_type"]
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def copy_bandwidth(threads: int) -> float:
    """Bytes per second a `copy_` of 256 MiB moves, reads and writes counted (best of 5)."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        clock = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - clock)
    return 2 * src.nbytes / best


def weight_bytes(lm: LoadedModel) -> int:
    """What one step reads of the weights: every matrix and norm once (a tied embedding as the lm_head;
    an untied embedding only gives one row, not counted)."""
    seen, total = set(), 0
    for module in lm.model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor is not None and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.nbytes
    return total


# --------------------------------------------------------------------------- speed


@dataclass(frozen=True)
class Row:
    history: int
    engine: str
    entries: int       # entries per layer and KV head
    tokens_per_s: float
    limit: float | None  # bandwidth limit, tokens/s


def speed(args: argparse.Namespace) -> str:
    threads = use_threads(args.threads)
    lm = load_model("default", args.models_dir)
    lm16 = load_model("default", args.models_dir, placement=BFLOAT16)
    lm8 = load_model("default", args.models_dir, weights="int8")
    lm4 = load_model("default", args.models_dir, weights="int4")
    data = inputs(lm, args.conversation)
    longest = max(args.lengths)
    bandwidth = copy_bandwidth(threads)
    log(f"{threads} threads, copy bandwidth {bandwidth / 1e9:.1f} GB/s, history {data.history.shape[-1]} tokens")

    llamas = []
    if importlib.util.find_spec("llama_cpp") is None:
        log("llama.cpp skipped: llama-cpp-python is not installed (pip install 'kvchat[bench]')")
    else:
        ids = torch.cat([data.prefix, data.history[:, :longest]], dim=-1)[0].tolist()
        for gguf in [default_gguf_path(), *args.gguf]:
            llamas.append(LlamaCpp(gguf, threads, n_ctx=8192))
            log(f"llama.cpp {llamas[-1].weights} prefill {len(ids)} tokens: {llamas[-1].prefill(ids):.0f} tokens/s")

    clock = time.perf_counter()
    full = full_cache(lm, data, longest)
    rate = full.next_position / (time.perf_counter() - clock)
    log(f"kvchat prefill {full.next_position} tokens: {rate:.0f} tokens/s")

    weights32, weights16, weights8, weights4 = (weight_bytes(x) for x in (lm, lm16, lm8, lm4))
    rows = []
    for n in sorted(args.lengths, reverse=True):  # llama.cpp keeps the longest history's prefix
        keep = data.prefix.shape[-1] + n
        whole, episode = episode_cache(lm, data, full, n)
        episode16 = in_dtype(episode, torch.bfloat16)
        cases = [
            ("kvchat, episode cache (budget 512), float32", lm, episode, weights32),
            ("kvchat, episode cache (budget 512), bfloat16", lm16, episode16, weights16),
            ("kvchat, episode cache (budget 512), int8 weights", lm8, episode, weights8),
            ("kvchat, episode cache (budget 512), int4 weights", lm4, episode, weights4),
            ("kvchat, full KV, float32", lm, whole, weights32),
            ("kvchat, full KV, int8 weights", lm8, whole, weights8),
            ("kvchat, full KV, int4 weights", lm4, whole, weights4),
        ]
        for engine, model, cache, wbytes in cases:
            kvchat_rate(model, cache, data.question, 4)  # warm-up: buffers, allocator
            rate = kvchat_rate(model, cache, data.question, args.tokens)
            limit = bandwidth / (wbytes + cache.nbytes())
            rows.append(Row(n, engine, max(cache.sizes), rate, limit))
            log(f"{n:5d} {engine}: {rate:.1f} tokens/s (limit {limit:.0f})")
        del whole, episode, episode16
        for llama in llamas:
            llama.rate(keep, data.question[0].tolist(), 4)  # warm-up, as kvchat's: its threads, its buffers
            rate = llama.rate(keep, data.question[0].tolist(), args.tokens)
            rows.append(Row(n, f"llama.cpp, full KV, {llama.weights} weights, f16 cache", keep, rate, None))
            log(f"{n:5d} llama.cpp {llama.weights}: {rate:.1f} tokens/s")
    return report(rows, threads, bandwidth, args, bool(llamas))


def report(rows: list[Row], threads: int, bandwidth: float, args: argparse.Namespace, with_llama: bool) -> str:
    load = os.getloadavg()[0]
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}, {threads} threads "
        f"(llama.cpp: {threads if with_llama else 'not installed'}); run {args.load}, 1-min load {load:.1f} at "
        f"the end; "
        f"{dt.date.today()}. Embedded SmolLM2-135M-Instruct, {args.conversation.stem} cut to each length, "
        f"{args.tokens} greedy tokens (end of turn ignored), copy bandwidth {bandwidth / 1e9:.1f} GB/s.",
        "",
        "| history tokens | engine | entries/layer/head | tokens/s | bandwidth limit | x kvchat full KV |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: r.history):
        base = next(r.tokens_per_s for r in rows if r.history == row.history and r.engine.startswith("kvchat, full"))
        limit = f"{row.limit:.0f}" if row.limit is not None else ""
        lines.append(f"| {row.history} | {row.engine} | {row.entries} | {row.tokens_per_s:.1f} | {limit} | "
                     f"{row.tokens_per_s / base:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- alternate

ENGINES = ("kvchat", "llama.cpp")


def alternate(args: argparse.Namespace) -> str:
    """kvchat's default on a CPU (the episode cache, int4 weights) against llama.cpp (full KV, Q4_1), each in a
    process of its own, taking turns `--runs` times per length (which goes first alternates)."""
    data = inputs(load_model("default", args.models_dir), args.conversation)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ids = Path(tmp) / "ids.json"
        ids.write_text(json.dumps({name: getattr(data, name)[0].tolist() for name in Inputs.__dataclass_fields__}))
        for n in args.lengths:
            for run in range(args.runs):
                order = ENGINES if run % 2 == 0 else ENGINES[::-1]
                rates = {engine: _alone(engine, n, ids, args) for engine in order}
                log(f"{n:5d} run {run + 1}: kvchat {rates['kvchat']:.1f}, llama.cpp {rates['llama.cpp']:.1f} tokens/s")
                results.append((n, rates))
    return alternate_report(results, args)


def _alone(engine: str, n: int, ids: Path, args: argparse.Namespace) -> float:
    """`engine`'s median tokens/s at `n` history tokens, measured by a process of its own (mode `one`)."""
    command = [sys.executable, __file__, "one", "--engine", engine, "--lengths", str(n), "--ids", str(ids),
               "--threads", str(args.threads), "--tokens", str(args.tokens), "--reps", str(args.reps),
               "--models-dir", str(args.models_dir)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{engine} at {n} tokens failed:\n{result.stderr}")
    return float(json.loads(result.stdout.splitlines()[-1])["median"])


def one(args: argparse.Namespace) -> None:
    """Mode `one` (alternate's child): `--engine`'s tokens/s at the one length, `--reps` answers after a warm-up,
    as a JSON line; nothing of the other engine is loaded."""
    threads = use_threads(args.threads)
    data = Inputs(**{name: torch.tensor([ids]) for name, ids in json.loads(args.ids.read_text()).items()})
    n = args.lengths[0]
    if args.engine == "llama.cpp":
        llama = LlamaCpp(default_gguf_path(), threads, n_ctx=8192)
        ids = torch.cat([data.prefix, data.history[:, :n]], dim=-1)[0].tolist()
        llama.prefill(ids)
        question = data.question[0].tolist()

        def measure(tokens: int) -> float:
            return llama.rate(len(ids), question, tokens)
    else:
        lm = load_model("default", args.models_dir)  # builds the cache in float32, as `speed`
        _, episode = episode_cache(lm, data, full_cache(lm, data, n), n)
        del lm
        lm4 = load_model("default", args.models_dir, weights="int4")

        def measure(tokens: int) -> float:
            return kvchat_rate(lm4, episode, data.question, tokens)
    measure(4)  # warm-up: threads, buffers
    rates = [measure(args.tokens) for _ in range(args.reps)]
    print(json.dumps({"rates": rates, "median": statistics.median(rates)}))


def alternate_report(results: list[tuple[int, dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}, {args.threads} threads "
        f"each; run {args.load}, 1-min load {os.getloadavg()[0]:.1f} at the end; {dt.date.today()}. Embedded "
        f"SmolLM2-135M-Instruct, "
        f"{args.conversation.stem} cut to each length, {args.tokens} greedy tokens (end of turn ignored). Each run: "
        f"kvchat's episode cache (budget 512) with int4 weights and llama.cpp over its full KV with Q4_1 weights, "
        f"each in a process of its own, the median of {args.reps} answers after a warm-up; which goes first "
        f"alternates. Ratio: kvchat over llama.cpp within a run; interval: percentile bootstrap of the mean ratio.",
        "",
        "| history tokens | runs | kvchat tokens/s (median) | llama.cpp tokens/s (median) | ratio: median (range) "
        "| mean ratio [95% interval] |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for n in sorted({n for n, _ in results}):
        rates = [r for m, r in results if m == n]
        ratios = [r["kvchat"] / r["llama.cpp"] for r in rates]
        low, high = bootstrap_interval(ratios)
        lines.append(
            f"| {n} | {len(rates)} | {statistics.median(r['kvchat'] for r in rates):.1f} | "
            f"{statistics.median(r['llama.cpp'] for r in rates):.1f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.mean(ratios):.2f} [{low:.2f}, {high:.2f}] |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- precision


def precision(args: argparse.Namespace) -> str:
    """Each lower precision against float32: full KV at `--context` tokens, the first `--questions`
    questions of each conversation."""
    use_threads(args.threads)
    lms = {
        "float32": load_model("default", args.models_dir),
        "int8 weights": load_model("default", args.models_dir, weights="int8"),
        "int4 weights": load_model("default", args.models_dir, weights="int4"),
        "bfloat16": load_model("default", args.models_dir, placement=BFLOAT16),
    }
    reference = lms["float32"]
    layout = ChatLayout.from_tokenizer(reference.tokenizer, SYSTEM_PROMPT)
    results: dict[str, list[tuple[float, float, bool]]] = {name: [] for name in lms if name != "float32"}
    for path in sorted(DATA.glob("conv-*.json")):
        data = inputs(reference, path)
        questions = [q["question"] for q in json.loads(path.read_text())["qa"][: args.questions]]
        answers: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        for name, lm in lms.items():
            if name == "bfloat16":  # its own cache: a bf16 model builds it
                with torch.inference_mode():
                    cache = block_prefill(lm.model, data.prefix, data.history[:, : args.context], block_size=BLOCK,
                                          budgets=None, scorer=None).cache  # fmt: skip
            elif name == "float32":
                with torch.inference_mode():
                    cache = block_prefill(lm.model, data.prefix, data.history[:, : args.context], block_size=BLOCK,
                                          budgets=None, scorer=None).cache  # fmt: skip
                float_cache = cache
            else:  # int8 and int4 weights answer from the float cache, as `kvchat ask --weights int8` does
                cache = float_cache
            answers[name] = []
            for question in questions:
                first: list[torch.Tensor] = []
                mark = cache.checkpoint()
                ids = list(generate(lm, cache, lm.encode(layout.question(question)), 32, first.append))
                cache.rollback(mark)
                answers[name].append((ids, first[0].float()))
            log(f"{path.stem} {name}: {len(questions)} answers")
        for name in results:
            for (ids32, logits32), (ids, logits) in zip(answers["float32"], answers[name], strict=True):
                p = logits32.log_softmax(-1)
                kl = float((p.exp() * (p - logits.log_softmax(-1))).sum())
                agreement = token_f1(reference.decode(ids), reference.decode(ids32))
                results[name].append((kl, agreement, ids[:1] == ids32[:1]))
    lines = [
        f"Against float32, full KV, {args.context}-token LoCoMo histories, {args.questions} questions per "
        f"conversation, 32-token greedy answers; run {args.load}.", "",
        "| weights | questions | first-token KL (mean) | max | agreement | same first token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        kls = [r[0] for r in rows]
        lines.append(f"| {name} | {len(rows)} | {statistics.mean(kls):.4f} | {max(kls):.4f} | "
                     f"{statistics.mean(r[1] for r in rows):.2f} | {sum(r[2] for r in rows)}/{len(rows)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("speed", "precision", "alternate", "one"), default="speed")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=LENGTHS)
    parser.add_argument("--conversation", type=Path, default=DATA / "conv-26.json")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--gguf", type=Path, action="append", default=[],
                        help="llama.cpp also over this GGUF of the same model (repeatable)")
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="where the embedded GGUF is converted")
    parser.add_argument("--runs", type=int, default=10, help="alternate: runs per length")
    parser.add_argument("--reps", type=int, default=5, help="alternate: answers per engine and run")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # mode one
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)  # mode one
    args = checked(parser, skip=lambda a: a.mode == "one")  # the parent of mode one checked
    if args.mode == "one":
        one(args)
        return
    text = {"speed": speed, "precision": precision, "alternate": alternate}[args.mode](args)
    default_out = {"speed": DEFAULT_OUT, "precision": DEFAULT_OUT.with_name("decode_precision.md"),
                   "alternate": DEFAULT_OUT.with_name("decode_alternate.md")}[args.mode]  # fmt: skip
    out = args.out or default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
