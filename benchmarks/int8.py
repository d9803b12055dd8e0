"""Quantized episode caches (`--cache-precision int8|int4`) against full precision: bytes, answer cost, decode
speed.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/int8.py --synthetic 2 --choose [--bits 4]  # pick G and R
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/int8.py DATA... [--max-context 4096] [--questions 12]
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/int8.py DATA... --speed   # decode tokens/s

Each conversation is ingested once with the default method at `--budget` (full precision, the embedded model's
float32) into a scratch store. Every question is routed as `kvchat ask` routes it and answered greedily from
the episode's full-precision cache (the reference) and from the same cache quantized (`EpisodeCache.quantize`,
exactly what `ingest --cache-precision int8|int4` stores: a test checks it) at each (precision, group,
residual) setting: by default int8 and int4 at their `CacheConfig` defaults. Measured per question against the
full-precision cache: first-answer-token KL(full || quantized), first-token agreement, answer agreement (token
F1 with the full-precision answer, as `kvchat eval`), each answer's LoCoMo F1 against the gold answer and
whether it contains the gold answer (planted facts: recall). Per episode: file bytes (the safetensors file the
store would write) and resident bytes (`EpisodeCache.nbytes`), each also as a share of the same entries in
float32 and (computed: the full-precision tensors converted, codes, scales and minima as they are) bfloat16.
`--speed`: decode tokens/s of the full, int8 and int4 caches of the first set's last routed episode,
alternating runs of the same prompt and token count in one process.

Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import LOCOMO_QA_TEMPLATE, CacheConfig, IngestConfig
from kvchat.eval.evaluate import _kl
from kvchat.eval.qa import QASet, contains_gold, load_locomo, planted_sets, sample_questions, score_answer, token_f1
from kvchat.history.episodes import route
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.quantize import PRECISION_BITS
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel, generate, load_model
from kvchat.store import Store

FULL = ("full", 0, 0)


def _answer(lm: LoadedModel, cache: EpisodeCache, prompt: torch.Tensor, tokens: int) -> tuple[torch.Tensor, str]:
    """First-token log-probabilities and the greedy answer, the cache rolled back afterwards."""
    first: list[torch.Tensor] = []
    mark = cache.checkpoint()
    try:
        answer = list(generate(lm, cache, prompt, tokens, first.append))
    finally:
        cache.rollback(mark)
    return first[0].float().log_softmax(-1), lm.decode(answer).strip()


def _file_bytes(cache: EpisodeCache, dtype: torch.dtype | None = None) -> int:
    """The episode file's bytes; with `dtype`, had the full-precision tensors (`k.*`, `v.*`) been in it."""
    meta = codec.meta_of(cache, fingerprint="x" * 64, method="epicache", positions="original")
    tensors, metadata = codec.encode(cache, meta)
    if dtype is not None:
        tensors = {k: t.to(dtype) if k.startswith(("k.", "v.")) else t for k, t in tensors.items()}
    return len(safetensors.torch.save(tensors, metadata | {"format_version": codec.format_version(metadata)}))


def _bfloat16_share(cache: EpisodeCache) -> float:
    """Resident bytes over those of the same entries in bfloat16, had the model run in bfloat16: the quantized
    part as it is (codes, scales and minima), the full-precision residual at 2 bytes a number."""
    from kvchat.kv.layers import QuantizedLayer

    ours = reference = 0
    for layer in cache.layers:
        dim = (layer.residual if isinstance(layer, QuantizedLayer) else layer).keys[0].shape[-1]
        reference += layer.entries * dim * 2 * 2
        if isinstance(layer, QuantizedLayer):
            ours += layer.nbytes() - layer.residual.nbytes() + layer.residual.entries * dim * 2 * 2
        else:
            ours += layer.entries * dim * 2 * 2
    return ours / reference


def _quantized(cache: EpisodeCache, precision: str, group: int, residual: int) -> EpisodeCache:
    copy = cache.copy()
    copy.quantize(group, residual, PRECISION_BITS[precision])
    return copy


def measure_set(qa: QASet, lm: LoadedModel, encoder: SentenceEncoder, store: Store, settings, args) -> dict:
    """Per setting: the per-question records and per-episode bytes (see the module docstring)."""
    config = IngestConfig(cache=CacheConfig(budget=args.budget))
    name = "int8-bench"
    ingest(qa.turns, name=name, config=config, store=store, lm=lm, encoder=encoder, replace=True, source=qa.name)
    record = store.get(name)
    layout = ChatLayout.from_tokenizer(lm.tokenizer, record.settings["system_prompt"])
    centroids = np.asarray([e.centroid for e in record.episodes], dtype=np.float32)
    caches: dict[tuple, EpisodeCache] = {}

    def cache_of(episode: int, setting) -> EpisodeCache:
        if (episode, *setting) not in caches:
            if setting == FULL:
                stored = store.load_episode(record.episodes[episode], lm.fingerprint)
                caches[(episode, *FULL)] = codec.decode(*stored)[0]
            else:
                caches[(episode, *setting)] = _quantized(cache_of(episode, FULL), *setting)
        return caches[(episode, *setting)]

    questions = sample_questions(qa.questions, args.questions)
    out = {s: {"answers": [], "bytes": {}} for s in settings}
    template = LOCOMO_QA_TEMPLATE if qa.sessions_total else "{question}"
    for n, question in enumerate(questions, 1):
        episode, _ = route(encoder.embed([question.text])[0], centroids)
        prompt = lm.encode(layout.question(template.format(question=question.text)))
        reference = None
        for setting in settings:
            cache = cache_of(episode, setting)
            logprobs, text = _answer(lm, cache, prompt, args.max_new_tokens)
            if reference is None:
                reference = (logprobs, text)
            out[setting]["answers"].append({
                "kl": _kl(reference[0], logprobs),
                "first_token": float(int(logprobs.argmax()) == int(reference[0].argmax())),
                "agreement": token_f1(text, reference[1]) if text or reference[1] else 1.0,
                "f1": score_answer(text, question),
                "recall": float(contains_gold(text, question)),
            })  # fmt: skip
            if episode not in out[setting]["bytes"]:
                out[setting]["bytes"][episode] = (
                    _file_bytes(cache),
                    cache.nbytes(),
                    _bfloat16_share(cache),
                    _file_bytes(cache, torch.bfloat16),
                )
        print(f"{qa.name}: {n}/{len(questions)}", file=sys.stderr)
    out["speed_episode"] = episode
    out["cache_of"] = cache_of
    store.remove(name)
    return out


def decode_speed(lm: LoadedModel, caches: dict[str, EpisodeCache], tokens: int, rounds: int) -> dict[str, float]:
    """Decode tokens/s over each cache: a fixed prompt, then `tokens` single-token forwards, alternating."""
    prompt = lm.encode("What did they talk about?")
    times: dict[str, list[float]] = {key: [] for key in caches}
    for _ in range(rounds):
        for key, cache in caches.items():
            mark = cache.checkpoint()
            forward(lm.model, cache, prompt)
            token = lm.encode(" the")[:, -1:]  # the same token every step: the work per step is what is timed
            start = time.perf_counter()
            for _ in range(tokens):
                forward(lm.model, cache, token)
            times[key].append(time.perf_counter() - start)
            cache.rollback(mark)
    return {key: tokens / statistics.median(t) for key, t in times.items()}


def _label(setting) -> str:
    """`full`, or the precision with its (group, residual)."""
    return "full" if setting == FULL else f"{setting[0]} ({setting[1]}, {setting[2]})"


def _pooled(results: dict, setting) -> str:
    answers = [a for result in results.values() for a in result[setting]["answers"]]
    agreement = statistics.mean(a["agreement"] for a in answers)
    return (f"{_label(setting)} KL {statistics.mean(a['kl'] for a in answers):.5f}, first "
            f"token {statistics.mean(a['first_token'] for a in answers):.1%}, answer agreement {agreement:.1%} "
            f"(loss {1 - agreement:.1%})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="*", type=Path, help="LoCoMo files")
    parser.add_argument("--synthetic", type=int, default=0, help="planted-fact conversations")
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--choose", action="store_true", help="compare groups and residuals 0/32/128 at --bits")
    parser.add_argument("--bits", type=int, choices=(8, 4), default=8,
                        help="--choose: 8 (groups 32/64/128) or 4 (groups 8/16/32)")  # fmt: skip
    parser.add_argument("--speed", action="store_true", help="also time decoding")
    parser.add_argument("--speed-tokens", type=int, default=32)
    parser.add_argument("--speed-rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = checked(parser)
    defaults = CacheConfig()
    chosen = [("int8", defaults.quant_group, defaults.quant_residual),
              ("int4", defaults.quant_group_4bit, defaults.quant_residual)]  # fmt: skip
    if args.choose:
        groups = (32, 64, 128) if args.bits == 8 else (8, 16, 32)
        settings = [FULL, *[(f"int{args.bits}", g, r) for g in groups for r in (0, 32, 128)]]
    else:
        settings = [FULL, *chosen]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    home = Path(os.environ.get("KVCHAT_HOME", tempfile.mkdtemp(prefix="kvchat-int8-")))
    store = Store(home)
    lm = load_model("default", store.models_dir)
    encoder = SentenceEncoder()
    count = lambda text: lm.encode(text).shape[-1]  # noqa: E731
    sets = [load_locomo(p, count_tokens=count, max_context=args.max_context) for p in args.data]
    sets += planted_sets(args.synthetic)
    with tempfile.TemporaryDirectory(prefix="kvchat-int8-store-") as scratch:
        scratch_store = Store(Path(scratch))
        results = {qa.name: measure_set(qa, lm, encoder, scratch_store, settings, args) for qa in sets}
        speed = None
        if args.speed:
            first = results[sets[0].name]
            caches = {_label(s): first["cache_of"](first["speed_episode"], s) for s in settings}
            speed = decode_speed(lm, caches, args.speed_tokens, args.speed_rounds)
    lines = [
        f"## quantized caches vs full precision ({dt.date.today()}, {platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), run {args.load})", "",
        f"Embedded SmolLM2-135M (float32), default method at budget {args.budget}, {args.questions} questions per "
        f"conversation (LoCoMo cut to {args.max_context} tokens), answers of up to {args.max_new_tokens} tokens. "
        "Reference: the same episode caches in full precision.", "",
        "| set | precision (group, residual) | file bytes / episode | resident bytes / episode | "
        "vs float32 (file / resident) | vs bfloat16, computed (file / resident) | "
        "KL(full‖quantized) mean | first token agrees | answer agreement | F1 vs gold | contains gold |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, result in results.items():
        base_file = None
        for setting in settings:
            r = result[setting]
            files = [b[0] for b in r["bytes"].values()]
            resident = [b[1] for b in r["bytes"].values()]
            file_mean, resident_mean = statistics.mean(files), statistics.mean(resident)
            base_file = base_file or (file_mean, resident_mean, statistics.mean(b[3] for b in r["bytes"].values()))
            answers = r["answers"]
            lines.append(
                f"| {name} | {_label(setting)} | {file_mean:,.0f} | {resident_mean:,.0f} | "
                f"{file_mean / base_file[0]:.1%} / {resident_mean / base_file[1]:.1%} | "
                f"{statistics.mean(b[3] for b in r['bytes'].values()) / base_file[2]:.1%} / "
                f"{statistics.mean(b[2] for b in r['bytes'].values()):.1%} | "
                f"{statistics.mean(a['kl'] for a in answers):.5f} | "
                f"{statistics.mean(a['first_token'] for a in answers):.1%} | "
                f"{statistics.mean(a['agreement'] for a in answers):.1%} | "
                f"{statistics.mean(a['f1'] for a in answers):.3f} | "
                f"{statistics.mean(a['recall'] for a in answers):.1%} |"
            )
    if len(results) > 1:
        lines += ["", "Pooled over the sets (mean of every question): "
                  + "; ".join(_pooled(results, s) for s in settings if s != FULL) + "."]  # fmt: skip
    if speed is not None:
        rates = ", ".join(f"{key} {tps:.1f} tokens/s ({tps / speed['full']:.2f}x)" for key, tps in speed.items())
        lines += ["", f"Decode, {args.speed_tokens} tokens after a short prompt, median of {args.speed_rounds} "
                  f"alternating runs on the episode of {sets[0].name}'s last question: {rates}."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
