"""--device / --dtype: resolution and refusals, caches that change dtype between ingest and ask, the fingerprint
rule (what must match, what may differ), the device-aware pre-flight, and decode attention's backends."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_main
from conftest import raises_said, random_ids, tiny_model, with_kvchat_attention
from safetensors import safe_open

from kvchat.config import DeviceConfig
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest import preflight
from kvchat.kv import backends, codec
from kvchat.kv.attention import HeadList, attend, kvchat_attention
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.model.device import resolve
from kvchat.model.llm import legacy_weights_fingerprint, load_model, model_fingerprint, weights_fingerprint

TINY = ("--budget", "64", "--setting", "block_size=32", "--episodes", "2")
CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------- resolution


def test_auto_is_cuda_bfloat16_with_a_gpu_else_cpu_float32():
    assert resolve(DeviceConfig(), cuda_available=False).describe() == "cpu float32"
    assert resolve(DeviceConfig(), cuda_available=True).describe() == "cuda bfloat16"
    assert resolve(DeviceConfig("cpu"), cuda_available=True).describe() == "cpu float32"
    assert resolve(DeviceConfig("cuda", "float16"), cuda_available=True).describe() == "cuda float16"
    assert resolve(DeviceConfig("auto", "bfloat16"), cuda_available=False).describe() == "cpu bfloat16"
    assert resolve(DeviceConfig("cpu", "bfloat16")).dtype_bytes == 2


@pytest.mark.parametrize(("config", "fragment"), [
    (DeviceConfig("cuda"), "--device cuda: torch sees no CUDA GPU here"),
    (DeviceConfig("cpu", "float16"), "--dtype float16 is not supported on the CPU"),
    (DeviceConfig("auto", "float16"), "--dtype float16 is not supported on the CPU"),
    (DeviceConfig("tpu"), "unknown --device 'tpu'"),
])
def test_what_this_machine_cannot_do_is_refused(config, fragment):
    with raises_said(UserError, fragment) as info:
        resolve(config, cuda_available=False)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["ingest", "ask", "eval", "profile-layers", "train-indexer"])
def test_every_model_command_refuses_cuda_without_a_gpu_in_one_line(command, tmp_path, tiny_model_dir):
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    args = {
        "ingest": ("ingest", str(history), "--model", str(tiny_model_dir)),
        "ask": ("ask", "hi"),
        "eval": ("eval", "--synthetic", "1", "--model", str(tiny_model_dir)),
        "profile-layers": ("profile-layers", "--model", str(tiny_model_dir)),
        "train-indexer": ("train-indexer", "--model", str(tiny_model_dir)),
    }[command]
    if command == "ask":  # ask loads the model of a stored conversation: store one first
        assert run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), *TINY).returncode == 0
    result = run_main(tmp_path, *args, "--device", "cuda")
    assert result.returncode == 2, result.stderr
    want = f"kvchat: error: --device cuda: torch sees no CUDA GPU here (torch {torch.__version__}); use --device cpu " \
           "or auto"
    assert result.stderr.strip() == want


def test_ingest_batch_takes_device_and_dtype():
    from kvchat.ingest.batch import gpu_share

    assert gpu_share(DeviceConfig("auto"), 0, 4) == 0
    assert gpu_share(DeviceConfig("auto"), 1, 4) == 0.25
    assert gpu_share(DeviceConfig("cuda"), 8, 4) == 1.0
    assert gpu_share(DeviceConfig("cpu"), 8, 4) == 0
    with pytest.raises(UserError, match="the Ray cluster has no GPU"):
        gpu_share(DeviceConfig("cuda"), 0, 4)
    result = run_main(__import__("pathlib").Path("/nonexistent"), "ingest-batch", "--help")
    assert "--device" in result.stdout and "--dtype" in result.stdout


# --------------------------------------------------------------------------- caches across dtypes


def test_a_cache_built_in_bfloat16_answers_in_float32_and_back(tmp_path, tiny_model_dir):
    """Ingest on the CPU in bfloat16 (as a GPU would store it), stored as built (storage model, not the default
    int8): the files hold bfloat16 keys and values; ask in
    float32 converts them on load, and gives the same routed episode as an ask in bfloat16."""
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    ingested = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), *TINY,
                        "--device", "cpu", "--dtype", "bfloat16", "--setting", "cache_storage=model", "--json")
    assert ingested.returncode == 0, ingested.stderr
    report = json.loads(ingested.stdout)
    assert (report["device"], report["dtype"], report["attention_backend"]) == ("cpu", "bfloat16", "torch")
    files = sorted((tmp_path / "caches").rglob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        assert f.get_tensor("k.0").dtype == torch.bfloat16 and f.get_tensor("pos.0").dtype == torch.int32
    answers = {}
    for dtype in ("float32", "bfloat16"):
        asked = run_main(tmp_path, "ask", "Where does Maya live?", "--device", "cpu", "--dtype", dtype,
                         "--max-new-tokens", "3", "--json")
        assert asked.returncode == 0, asked.stderr
        answers[dtype] = json.loads(asked.stdout)
    assert answers["float32"]["episode"] == answers["bfloat16"]["episode"]
    assert answers["float32"]["attention_backend"] == "torch"


def test_quantized_weights_elsewhere_than_on_the_cpu_are_refused_naming_what_to_do(tiny_model_dir, tmp_path):
    """The int8/int4 kernels are torch's CPU ones: on another device (a GPU; the meta device stands in) the
    refusal comes before any file is read and says what to pass instead."""
    from kvchat.model.device import Placement
    from kvchat.model.llm import load_model

    with raises_said(UserError, r"^--weights int4 runs on the CPU .*, not on meta: add --device cpu, or use "
                                        r"--weights float$"):
        load_model(str(tiny_model_dir), tmp_path, placement=Placement(torch.device("meta"), torch.float32),
                   weights="int4")
    assert not any(tmp_path.iterdir())


def test_ingest_builds_with_the_weights_asked_for_and_any_weights_answer(tmp_path, tiny_model_dir):
    """`ingest --weights int4` builds with int4 weights (kept in models/held/) and says so, in its report and in
    `show`; `ask --weights float` answers from those caches."""
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    ingested = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), *TINY, "--weights", "int4",
                        "--device", "cpu", "--json")  # fmt: skip
    assert ingested.returncode == 0, ingested.stderr
    assert json.loads(ingested.stdout)["weights"] == "int4" and (tmp_path / "models" / "held").is_dir()
    assert json.loads(run_main(tmp_path, "show", "h", "--json").stdout)["weights"] == "int4"
    asked = run_main(tmp_path, "ask", "Where does Maya live?", "--weights", "float", "--max-new-tokens", "3", "--json")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["weights"] == "float"
    float_ingest = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), *TINY, "--name", "f",
                            "--json")  # fmt: skip
    assert json.loads(float_ingest.stdout)["weights"] == "float"  # auto: the tiny model's random weights as loaded


def test_codec_decode_converts_to_the_models_dtype(model):
    result = block_prefill(model, random_ids(4, 1), random_ids(60, 2), block_size=16, budgets=[24, 24],
                           scorer=PatchedPromptScorer(random_ids(6, 3)), heads=HeadBudgets("adaptive"))
    meta = codec.meta_of(result.cache, fingerprint="fp", method="epicache", positions="original")
    tensors, metadata = codec.encode(result.cache, meta)
    halved = {k: v.to(torch.bfloat16) if k[0] in "kv" else v for k, v in tensors.items()}
    cache, _ = codec.decode(halved, metadata, dtype=torch.float32, device="cpu")
    for layer, original in zip(cache.layers, result.cache.layers, strict=True):
        keys = layer.keys if layer.ragged else [layer.keys]
        assert all(k.dtype == torch.float32 for k in keys)
        want = original.keys if original.ragged else [original.keys]
        for k, w in zip(keys, want, strict=True):
            torch.testing.assert_close(k, w.to(torch.bfloat16).float())
        assert layer.lengths == original.lengths
    as_stored, _ = codec.decode(halved, metadata)  # no dtype: as stored
    assert as_stored.layers[0].keys[0].dtype == torch.bfloat16


# --------------------------------------------------------------------------- the fingerprint rule


def test_fingerprint_ignores_dtype_and_device_but_not_the_weights(tiny_model_dir, tmp_path):
    """float32 and bfloat16 loads of one checkpoint share a fingerprint; other weights or shapes do not."""
    f32 = load_model(str(tiny_model_dir), tmp_path, placement=resolve(DeviceConfig("cpu", "float32")))
    bf16 = load_model(str(tiny_model_dir), tmp_path, placement=resolve(DeviceConfig("cpu", "bfloat16")))
    assert bf16.model.dtype == torch.bfloat16
    assert f32.fingerprint == bf16.fingerprint and "torch." not in f32.fingerprint
    assert weights_fingerprint(f32.model) == weights_fingerprint(bf16.model)
    other = tiny_model("llama", vocab_size=f32.model.config.vocab_size, seed=1)
    assert weights_fingerprint(other) != weights_fingerprint(f32.model)
    nudged = tiny_model("llama", vocab_size=f32.model.config.vocab_size)
    with torch.no_grad():
        nudged.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0  # one sampled value moved by far more than rounding
    assert weights_fingerprint(nudged) != weights_fingerprint(tiny_model("llama", vocab_size=nudged.config.vocab_size))
    three_layers = tiny_model("llama", vocab_size=f32.model.config.vocab_size, layers=3)
    assert model_fingerprint("m", three_layers) != model_fingerprint("m", f32.model)
    assert legacy_weights_fingerprint(f32.model) is not None and legacy_weights_fingerprint(bf16.model) is None


def test_a_cache_with_an_older_fingerprint_is_refused_with_the_rebuild_command():
    from kvchat.store import _check_fingerprint

    def refuse(problem: str) -> CacheIntegrityError:
        return CacheIntegrityError(f"cache {problem}; rebuild with `kvchat ingest ...`")

    current = "m|w=0123456789abcdef|L2xKV2xD16|transformers=5"
    _check_fingerprint({"fingerprint": current}, current, refuse)
    with pytest.raises(CacheIntegrityError, match="fingerprint of an older kvchat .*rebuild with"):
        _check_fingerprint({"fingerprint": "m|w=0123|torch.float32|L2xKV2xD16|transformers=5"}, current, refuse)
    with pytest.raises(CacheIntegrityError, match="different model"):
        _check_fingerprint({"fingerprint": current.replace("0123", "9999")}, current, refuse)


def test_a_conversation_of_an_older_kvchat_is_refused_with_the_command_that_rebuilds_it(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Ingested while fingerprints carried the dtype (as kvchat wrote them before): ask and --append refuse it in
    one line naming `kvchat ingest ... --replace`."""
    import kvchat.model.llm

    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    current = kvchat.model.llm.model_fingerprint
    with monkeypatch.context() as patched:
        patched.setattr(kvchat.model.llm, "model_fingerprint",
                        lambda name, model: current(name, model).replace("|L", "|torch.float32|L"))
        old = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), *TINY, "--name", "old")
        assert old.returncode == 0, old.stderr
    for args in (("ask", "Where?"), ("ingest", str(history), "--append", "--name", "old")):
        result = run_main(tmp_path, *args)
        assert result.returncode == 2, result.stderr
        lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("kvchat: episode")]
        assert len(lines) == 1 and "older kvchat" in lines[0] and "--name old" in lines[0], result.stderr
        assert "--replace" in lines[0]


def test_profiles_made_before_the_new_fingerprint_are_still_found(tiny_lm, tmp_path):
    from kvchat.ingest.layer_profiles import LayerProfile, find_profile

    legacy = legacy_weights_fingerprint(tiny_lm.model)
    LayerProfile("tiny", legacy, {}, 400, [0.7, 0.6], [0.3, 0.4], alpha=1.5).save(tmp_path / "old.json")
    assert find_profile(tiny_lm, [tmp_path]).weights == legacy


# --------------------------------------------------------------------------- pre-flight


def test_preflight_reads_gpu_memory_on_cuda():
    assert preflight.available_bytes("cuda", cuda_free=lambda device: (3 << 30, 80 << 30)) == 3 << 30
    with pytest.raises(UserError, match=r"of GPU memory \(cuda:0\) at its peak .* only 1\.0 MiB is available"):
        preflight.check_fits(10**9, resident=10**8, available=2**20, device="cuda:0")


def test_preflight_counts_the_dtypes_bytes(tiny_model_dir, tmp_path):
    f32 = load_model(str(tiny_model_dir), tmp_path)
    bf16 = load_model(str(tiny_model_dir), tmp_path, placement=resolve(DeviceConfig("cpu", "bfloat16")))
    shapes = [preflight.ModelShape.of(lm.model) for lm in (f32, bf16)]
    assert [s.dtype_bytes for s in shapes] == [4, 2]
    settings = {"budget": 1024, "block_size": 512, "prompt_tokens": 272, "context_tokens": 20_000, "full": False}
    f32_bytes, bf16_bytes = (preflight.estimate_ingest_bytes(s, **settings) for s in shapes)
    assert bf16_bytes < f32_bytes


# --------------------------------------------------------------------------- decode attention


def _eager(query, keys, values, scale, softcap=None):
    """softmax(QK^T) V by hand for one decode query `[1, H, 1, D]` over per-KV-head keys and values."""
    group = query.shape[1] // len(keys)
    out = []
    for h in range(query.shape[1]):
        k, v = keys[h // group][0, 0].float(), values[h // group][0, 0].float()
        logits = (query[0, h].float() @ k.T) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        out.append(logits.softmax(-1) @ v)
    return torch.stack(out)[None].transpose(1, 2)  # [1, 1, H, D]


class _Module:
    layer_idx = 0


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("layout", ["uniform", "ragged"])
def test_decode_attention_equals_eager_softmax(layout, softcap):
    torch.manual_seed(0)
    query = torch.randn(1, 8, 1, 16) * 2
    lengths = [37, 37] if layout == "uniform" else [37, 5]
    keys = [torch.randn(1, 1, n, 16) * 2 for n in lengths]
    values = [torch.randn(1, 1, n, 16) for n in lengths]
    k, v = (torch.cat(keys, dim=1), torch.cat(values, dim=1)) if layout == "uniform" else (HeadList(keys),
                                                                                            HeadList(values))
    out, _ = kvchat_attention(_Module(), query, k, v, None, scaling=0.25, softcap=softcap)
    torch.testing.assert_close(out, _eager(query, keys, values, 0.25, softcap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_query_attends_alike_through_either_cpu_kernel(threads):
    """`attend` picks SDPA or the grouped matmuls for one query by thread count and length: both give the eager
    softmax's output."""
    torch.manual_seed(1)
    query = torch.randn(1, 8, 1, 16) * 2
    keys, values = [torch.randn(1, 1, 40, 16) * 2 for _ in range(2)], [torch.randn(1, 1, 40, 16) for _ in range(2)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attend(query, torch.cat(keys, dim=1), torch.cat(values, dim=1), None, 0.25)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.transpose(1, 2), _eager(query, keys, values, 0.25, None), rtol=1e-5, atol=1e-5)


def test_the_backend_is_torch_without_cuda_or_the_extra():
    assert backends.decode_backend(torch.device("cpu"), torch.bfloat16) == "torch"
    assert backends.decode_backend(torch.device("cuda"), torch.float32) == "torch"  # flashinfer: half only
    q = torch.randn(1, 4, 1, 16)
    assert backends.flashinfer_decode(q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), 0.25) is None


def test_debug_prints_where_the_model_runs_and_its_backend(tmp_path, tiny_model_dir):
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    result = run_main(tmp_path, "--debug", "ingest", str(history), "--model", str(tiny_model_dir), *TINY,
                      "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert f"kvchat: debug: {tiny_model_dir} on cpu float32, decode attention: torch" in result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or not backends.flashinfer_installed(), reason="needs CUDA and the flashinfer extra")
@pytest.mark.parametrize("layout", ["uniform", "ragged"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flashinfer_decode_equals_torch(layout, softcap):
    """On a GPU with flashinfer: kvchat's decode attention (flashinfer) against torch's on the same tensors."""
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    query = torch.randn(1, 32, 1, 128, device=device, dtype=dtype)
    lengths = [1000] * 8 if layout == "uniform" else [1000, 17, 600, 300, 1, 999, 64, 512]
    keys = [torch.randn(1, 1, n, 128, device=device, dtype=dtype) for n in lengths]
    values = [torch.randn(1, 1, n, 128, device=device, dtype=dtype) for n in lengths]
    k, v = (torch.cat(keys, dim=1), torch.cat(values, dim=1)) if layout == "uniform" else (HeadList(keys),
                                                                                            HeadList(values))
    assert backends.decode_backend(device, dtype) == "flashinfer"
    got, _ = kvchat_attention(_Module(), query, k, v, None, scaling=128**-0.5, softcap=softcap)
    want = _eager(query, keys, values, 128**-0.5, softcap).to(dtype)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    if softcap is None and layout == "uniform":
        sdpa = F.scaled_dot_product_attention(query, k, v, scale=128**-0.5, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(got, sdpa, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_cuda_decode_gives_the_cpu_logits():
    """The tiny model on CUDA in float32 (torch backend) decodes what the CPU decodes."""
    cpu = with_kvchat_attention(tiny_model("llama"))
    gpu = with_kvchat_attention(tiny_model("llama")).cuda()
    prefix, context, token = random_ids(4, 1), random_ids(60, 2), random_ids(1, 3)
    want = forward(cpu, block_prefill(cpu, prefix, context, block_size=16, budgets=[24, 24],
                                      scorer=PatchedPromptScorer(random_ids(6, 4))).cache, token)
    got = forward(gpu, block_prefill(gpu, prefix.cuda(), context.cuda(), block_size=16, budgets=[24, 24],
                                     scorer=PatchedPromptScorer(random_ids(6, 4).cuda())).cache, token.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)


def test_a_failed_cuda_initialisation_is_no_python_warning_and_is_named_when_cuda_is_asked_for(monkeypatch):
    """torch warns when CUDA fails to initialise (a busy or broken driver): kvchat keeps that warning off the
    terminal and names it in `--device cuda`'s refusal."""
    def failing() -> bool:
        warnings.warn("CUDA initialization: Unexpected error from cudaGetDeviceCount()\nsecond line", UserWarning,
                      stacklevel=2)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", failing)
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        assert resolve(DeviceConfig()).describe() == "cpu float32"
        with raises_said(UserError, r"no CUDA GPU here \(torch .*: CUDA initialization: Unexpected error from "
                                    r"cudaGetDeviceCount\(\)\); use --device cpu or auto$"):
            resolve(DeviceConfig("cuda"))
    assert escaped == []
