"""Does `torch.compile` pay off for answering on the CPU? Compile time against the answers a session asks.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/compile_speed.py [--variants eager,mlp,...]
        [--tokens 48] [--questions 10] [--threads 1] [--rows PATH.jsonl] [--out PATH.md] [--render]

The setup of `decode_speed.py` (whose helpers it imports): LoCoMo conv-26 cut to 4096 history tokens, the
episode cache `--prefill full` selects from it (budget 512 per layer and KV head, patched prompt), the
embedded SmolLM2-135M, greedy answers of `--tokens` tokens (end of turn ignored, so every variant does the
same work). Each variant runs in a fresh process (this script, `--child VARIANT`), so neither dynamo's
caches nor inductor's in-process state carry from one row to the next (inductor's on-disk cache is pointed
at a fresh temporary directory per process for the same reason). Compilation goes through the public
`nn.Module.compile()` on the loaded model's modules, after the cache is built with the eager model:

- `eager`: float32, no compilation (the reference);
- `mlp`: each decoder layer's MLP and its two RMSNorms, and the final norm;
- `layers`: each decoder layer;
- `model`: the whole model (default mode, `dynamic=None`);
- `model-dynamic`: the whole model with `dynamic=True`;
- `model-dynamic-warm`: `model-dynamic` in a second process that finds inductor's on-disk cache
  (`TORCHINDUCTOR_CACHE_DIR`) filled by a first one (measured only after that first run);
- `int8-eager`, `int8-mlp`, `int8-layers`, `int8-model-dynamic`: with int8 weights (`kvchat.model.int8_weights`,
  as `--weights int8`: the cache built with the float weights), eager and compiled.

Per variant, on the cache: the first answer to question 0 (its wall time less `--tokens` tokens at the
steady rate is the compile time) and the same answer again, the steady decode tokens/s
(`decode_speed.kvchat_rate`: the steps after the first token, after the same answer ran twice), then a
session: `--questions` further LoCoMo questions answered one after another through `kvchat.model.llm.generate`
(each rolled back), so recompiles on new question lengths and cache positions count in its wall time.
Recompiles are counted from dynamo's `recompiles` log (`torch._logging.set_logs`), graphs from
`torch._dynamo.utils.counters`. The first answer token's logits are compared with those of the eager
variant with the same weights (max |difference|). A variant that fails (an exception, a crash, past
`--child-timeout`) is a row saying how.

Rows go to `--rows` (JSON lines: a variant measured again replaces its row, so variants can be measured in
separate runs; `--render` only rewrites the table); the markdown table of every row there goes to stdout and
`--out`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _load import checked
from core_loop import cpu_name  # benchmarks/ is on sys.path
from decode_speed import BLOCK, BUDGET, DATA, inputs, kvchat_rate

from kvchat.config import SYSTEM_PROMPT, default_home
from kvchat.kv.budgets import uniform_budgets
from kvchat.kv.prefill import block_prefill, select_from
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.model.int8_weights import quantize_linears
from kvchat.model.llm import ChatLayout, generate, load_model, use_threads
from kvchat.store import MODELS_DIR

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
WORKDIR = Path(tempfile.gettempdir()) / "kvchat-compile-speed"  # first-token logits of each variant's last run
HISTORY = 4096

# name: (weights, what is compiled, torch.compile keyword arguments)
VARIANTS: dict[str, tuple[str, str | None, dict]] = {
    "eager": ("float", None, {}),
    "mlp": ("float", "mlp", {}),
    "layers": ("float", "layers", {}),
    "model": ("float", "model", {}),
    "model-dynamic": ("float", "model", {"dynamic": True}),
    "model-dynamic-warm": ("float", "model", {"dynamic": True}),
    "int8-eager": ("int8", None, {}),
    "int8-mlp": ("int8", "mlp", {}),
    "int8-layers": ("int8", "layers", {}),
    "int8-model-dynamic": ("int8", "model", {"dynamic": True}),
}
DEFAULT_VARIANTS = ("eager", "mlp", "layers", "model", "model-dynamic", "int8-eager", "int8-mlp")
DESCRIPTIONS = {
    None: "eager",
    "mlp": "MLP + RMSNorms compiled",
    "layers": "each decoder layer compiled",
    "model": "whole model compiled",
}


def log(message: str) -> None:
    print(f"[compile_speed {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one variant (child process)


def failed_row(name: str, error: str) -> dict:
    """A row that says what the variant is and, until it succeeds, how it failed."""
    weights, target, options = VARIANTS[name]
    return {"variant": name, "weights": weights, "target": target, "options": options, "ok": False, "error": error}


def compile_modules(model: torch.nn.Module, target: str, options: dict) -> int:
    """Compile `target`'s modules of a Llama-family `model` in place (`nn.Module.compile`); how many."""
    decoder = model.model
    if target == "model":
        modules = [model]
    elif target == "layers":
        modules = list(decoder.layers)
    elif target == "mlp":
        modules = [decoder.norm]
        for layer in decoder.layers:
            modules += [layer.input_layernorm, layer.mlp, layer.post_attention_layernorm]
    else:
        raise ValueError(f"unknown compile target {target!r}")
    for module in modules:
        module.compile(**options)
    return len(modules)


class RecompileLog(logging.Handler):
    """Collects dynamo's recompile records (its `recompiles` log artifact, on that artifact's own logger)
    and notes a warning that a recompile limit was hit (on `torch._dynamo`'s)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []
        self.limit_hit = False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.name.endswith("__recompiles") and message.startswith("Recompiling function"):
            lines = [line.strip() for line in message.splitlines()]
            reason = next((line.removeprefix("- ") for line in lines if line.startswith("- ")), "")
            self.reasons.append(f"{lines[0].split(' in ')[0].removeprefix('Recompiling function ')}: {reason}")
        elif "hit config." in message and "limit" in message:
            self.limit_hit = True

    def attach(self) -> None:
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(self)
        logging.getLogger("torch._dynamo").addHandler(self)


def timed_answer(lm, cache, ids: torch.Tensor, tokens: int) -> tuple[float, list[int], torch.Tensor]:
    """Wall seconds of one forced-length answer through `llm.generate`, its ids and first-token logits;
    the cache is rolled back."""
    first: list[torch.Tensor] = []
    mark = cache.checkpoint()
    clock = time.perf_counter()
    answer = list(generate(lm, cache, ids, tokens, first.append, stop_ids=()))
    seconds = time.perf_counter() - clock
    cache.rollback(mark)
    return seconds, answer, first[0].detach().float().clone()


def run_variant(name: str, args: argparse.Namespace) -> dict:
    weights, target, options = VARIANTS[name]
    row = failed_row(name, "")
    recompiles = RecompileLog()
    recompiles.attach()
    from torch._dynamo.utils import counters

    row["threads"] = use_threads(args.threads)
    lm = load_model("default", args.models_dir)
    data = inputs(lm, args.conversation)
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    qa = json.loads(args.conversation.read_text())["qa"]
    session = [lm.encode(layout.question(q["question"])) for q in qa[1 : 1 + args.questions]]
    clock = time.perf_counter()
    with torch.inference_mode():
        full = block_prefill(lm.model, data.prefix, data.history[:, :HISTORY], block_size=BLOCK, budgets=None,
                             scorer=None).cache  # fmt: skip
        budgets = uniform_budgets(lm.num_layers, BUDGET)
        cache = select_from(lm.model, full, data.history[:, HISTORY - BLOCK : HISTORY], budgets=budgets,
                            scorer=PatchedPromptScorer(data.patched))  # fmt: skip
    del full
    row["cache_entries"] = max(cache.sizes)
    log(f"{name}: episode cache of {row['cache_entries']} entries/layer/head in {time.perf_counter() - clock:.1f} s")
    if weights == "int8":  # as load_model(weights="int8") does, after the float model built the cache
        quantize_linears(lm.model)
    try:
        if target is not None:
            row["compiled_modules"] = compile_modules(lm.model, target, options)
        row["first_answer_s"], answer, logits = timed_answer(lm, cache, data.question, args.tokens)
        log(f"{name}: first answer {row['first_answer_s']:.1f} s")
        row["repeat_answer_s"], again, _ = timed_answer(lm, cache, data.question, args.tokens)
        row["tokens_per_s"] = kvchat_rate(lm, cache, data.question, args.tokens)
        log(f"{name}: {row['tokens_per_s']:.1f} tokens/s; session of {len(session)} questions")
        before = len(recompiles.reasons)
        clock = time.perf_counter()
        for ids in session:
            mark = cache.checkpoint()
            for _ in generate(lm, cache, ids, args.tokens, stop_ids=()):
                pass
            cache.rollback(mark)
        row["session_s"] = time.perf_counter() - clock
        row["session_recompiles"] = len(recompiles.reasons) - before
        row["answer"], row["answer_repeatable"] = answer, answer == again
        torch.save(logits, args.logits)
        row["ok"] = True
        del row["error"]
    except Exception as exc:  # a variant that fails is a row saying how
        lines = str(exc).strip().splitlines() or [""]
        row["error"] = f"{type(exc).__name__}: {lines[0][:200]}"
        log(f"{name}: failed: {row['error']}")
    row["recompiles"] = len(recompiles.reasons)
    row["recompile_reasons"] = sorted(set(recompiles.reasons))[:12]
    row["recompile_limit_hit"] = recompiles.limit_hit
    row["graphs"] = int(counters["stats"]["unique_graphs"])
    row["graph_breaks"] = int(sum(counters["graph_break"].values()))
    return row


# --------------------------------------------------------------------------- driver


def run_child(name: str, args: argparse.Namespace, inductor_dir: Path) -> dict:
    """`name` in a fresh process with a fresh inductor cache directory; a crash or timeout is a failed row.
    A `-warm` variant runs twice on one cache directory and reports the second run (a new process with
    inductor's on-disk caches filled, as a second `kvchat ask` would find them)."""
    if name.endswith("-warm"):
        log(f"{name}: a first run fills the inductor cache")
        first = run_child_once(name, args, inductor_dir)
        if not first.get("ok"):
            return {**first, "error": f"the run filling the cache failed: {first.get('error')}"}
    return run_child_once(name, args, inductor_dir)


def run_child_once(name: str, args: argparse.Namespace, inductor_dir: Path) -> dict:
    WORKDIR.mkdir(exist_ok=True)
    logits = WORKDIR / f"{name}.logits.pt"
    logits.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--child", name, "--logits", str(logits), "--tokens", str(args.tokens),
               "--questions", str(args.questions), "--threads", str(args.threads),
               "--conversation", str(args.conversation), "--models-dir", str(args.models_dir)]  # fmt: skip
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir / name))
    log(f"{name}: starting")
    clock = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return failed_row(name, f"no result within {args.child_timeout:.0f} s (killed)")
    sys.stderr.write("".join(f"    {line}\n" for line in done.stderr.splitlines()[-6:]))
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return failed_row(name, f"process exited {done.returncode}: {last[:200]}")
    row = json.loads(rows[-1])
    row["process_s"] = time.perf_counter() - clock
    if row["ok"]:
        row["logits_file"] = logits.name  # in WORKDIR
    return row


def logits_file(row: dict) -> Path:
    """A row's first-token logits, in WORKDIR (`logits_file` names the file)."""
    return WORKDIR / Path(row.get("logits_file") or "none").name


def compare(rows: list[dict]) -> None:
    """Ratios and logit differences against the eager row with the same weights (in place)."""
    references = {row["weights"]: row for row in rows if row.get("ok") and row.get("target") is None}
    for row in rows:
        reference = references.get(row.get("weights"))
        files = [logits_file(r) for r in (row, reference or {})]
        if not row.get("ok") or reference is None or not all(f.is_file() for f in files):
            continue
        row["decode_ratio"] = row["tokens_per_s"] / reference["tokens_per_s"]
        row["session_ratio"] = reference["session_s"] / row["session_s"]
        ours, theirs = torch.load(files[0]), torch.load(files[1])
        row["max_logit_diff"] = float((ours - theirs).abs().max())
        row["same_answer"] = row["answer"] == reference["answer"]
        floats = references.get("float")
        if row["weights"] != "float" and floats is not None and logits_file(floats).is_file():
            row["max_logit_diff_float"] = float((ours - torch.load(logits_file(floats))).abs().max())


def compile_seconds(row: dict, tokens: int) -> float:
    """What the first answer took beyond one at the steady rate: compiling (tracing, inductor, recompiles)."""
    return row["first_answer_s"] - tokens / row["tokens_per_s"]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    threads = next((row["threads"] for row in rows if "threads" in row), args.threads)
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_name()}); torch "
        f"{torch.__version__}, {threads} thread; {dt.date.today()}. Embedded SmolLM2-135M-Instruct, "
        f"{args.conversation.stem} cut to {HISTORY} history tokens, episode cache budget {BUDGET} "
        f"(`--prefill full`'s selection), {args.tokens} greedy tokens per answer (end of turn ignored), each "
        f"variant in a fresh process. Compile s: the first answer's wall time less {args.tokens} tokens at the "
        f"steady rate; the second answer is the same question again. Ratios and logit differences against eager "
        f"with the same weights."
        + (f" The variants measured in this run ({', '.join(args.variants)}) ran {args.load}." if args.load else ""),
        "",
        "| weights | variant | first / second answer s | compile s | tokens/s | x eager | "
        f"{args.questions}-question session s | x eager | recompiles (in session) | graphs | "
        f"max abs first-token logit diff (int8: vs float32 eager) | same {args.tokens}-token answer |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        weights = "int8" if row.get("weights") == "int8" else "float32"
        what = DESCRIPTIONS.get(row.get("target"), row.get("target")) or row["variant"]
        if row["variant"].endswith("-warm"):
            what += ", inductor's cache filled by an earlier process"
        if row.get("options"):
            what += ", " + ", ".join(f"{k}={v}" for k, v in row["options"].items())
        if not row.get("ok"):
            lines.append(f"| {weights} | {what} ({row['variant']}) | failed: {row.get('error', '?')} ||||||||||")
            continue
        limit = ", hit the recompile limit" if row.get("recompile_limit_hit") else ""
        against_float = f" ({row['max_logit_diff_float']:.1e})" if "max_logit_diff_float" in row else ""
        lines.append(
            f"| {weights} | {what} | {row['first_answer_s']:.1f} / {row['repeat_answer_s']:.1f} | "
            f"{compile_seconds(row, args.tokens):.1f} | {row['tokens_per_s']:.1f} | "
            f"{row.get('decode_ratio', float('nan')):.2f} | {row['session_s']:.1f} | "
            f"{row.get('session_ratio', float('nan')):.2f} | "
            f"{row['recompiles']} ({row['session_recompiles']}{limit}) | "
            f"{row['graphs']} | {row.get('max_logit_diff', float('nan')):.1e}{against_float} | "
            f"{'yes' if row.get('same_answer') else 'no'} |"
        )
    reasons = [(row["variant"], reason) for row in rows if row.get("ok") for reason in row["recompile_reasons"][:3]]
    if reasons:
        lines += ["", "First recompile reasons (dynamo's `recompiles` log, up to 3 distinct per variant):", ""]
        lines += [f"- {variant}: `{reason[:160]}`" for variant, reason in reasons]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--conversation", type=Path, default=DATA / "conv-26.json")
    parser.add_argument("--models-dir", type=Path, default=default_home() / MODELS_DIR,
                        help="where the embedded GGUF is converted")  # fmt: skip
    parser.add_argument("--rows", type=Path, default=RESULTS / "records" / "compile_speed.jsonl")
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_speed.md")
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--render", action="store_true", help="only rewrite the table from --rows' rows")
    parser.add_argument("--child", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--logits", type=Path, help=argparse.SUPPRESS)
    args = checked(parser, skip=lambda a: a.child is not None or a.render)  # the parent checked for a child
    if args.child:
        print(json.dumps(run_variant(args.child, args)), flush=True)
        return
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown} (choose from {', '.join(VARIANTS)})")
    kept = [json.loads(line) for line in args.rows.read_text().splitlines()] if args.rows.is_file() else []
    if args.render:
        args.variants = []
    with tempfile.TemporaryDirectory(prefix="kvchat-compile-speed-inductor-") as inductor_dir:
        fresh = [run_child(name, args, Path(inductor_dir)) for name in args.variants]
    for row in fresh:
        row["load"] = args.load.record()
    rows = [row for row in kept if row["variant"] not in args.variants] + fresh
    rows.sort(key=lambda row: list(VARIANTS).index(row["variant"]))
    compare(rows)
    args.rows.parent.mkdir(parents=True, exist_ok=True)
    args.rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = table(rows, args)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
