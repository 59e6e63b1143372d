"""The test-only SGLang environment: SGLang 0.5.23's wheel and the few packages its pure-Python
modules import, installed `--no-deps` into a --target directory under ~/.cache/draftsmith,
keyed by a hash of the requirement lists (and the Python tag, the wheels are cp311). The main
venv is untouched: SGLang runs in a subprocess with this directory first on PYTHONPATH and the
venv's torch 2.13 CPU underneath. Source-only wheels (vLLM's, sources.txt) are downloaded, not
installed, and cut down to their .py files (vLLM 0.34's wheel is 239 MB, its Python 14 MB).

    python -m tests.sglang_conformance.env      # build (or find) it and print its path

DRAFTSMITH_SGLANG_ENV points at a prebuilt directory instead. A build that fails fails the
tests that need it; nothing is skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REQUIREMENTS = HERE / "requirements.txt"
SOURCES = HERE / "sources.txt"
COMPLETE = ".complete"
WHEELS = "wheels"


def env_key() -> str:
    digest = hashlib.sha256()
    for f in (REQUIREMENTS, SOURCES):
        digest.update(f.read_bytes())
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}"
    digest.update(tag.encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    return Path.home() / ".cache" / "draftsmith" / "sglang-env"


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the SGLang test environment failed: {' '.join(command)}\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def build(out: Path) -> None:
    """Install into a temporary sibling, then rename: a killed build leaves no half env."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _pip("install", "--quiet", "--no-deps", "--only-binary", ":all:", "--target", str(tmp),
             "-r", str(REQUIREMENTS))
        _pip("download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest",
             str(tmp / WHEELS), "-r", str(SOURCES))
        for wheel in (tmp / WHEELS).glob("*.whl"):
            keep_python_sources(wheel)
        (tmp / COMPLETE).write_text(env_key())
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def keep_python_sources(wheel: Path) -> None:
    """Rewrite a downloaded wheel with its .py files alone: the tests read nothing else, and the
    compiled kernels would make the cache ten times larger."""
    trimmed = wheel.with_suffix(".py.zip")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(
            trimmed, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for member in source.infolist():
            if member.filename.endswith(".py"):
                out.writestr(member, source.read(member))
    trimmed.replace(wheel)


def ensure_env() -> Path:
    """The environment's directory, built once per requirement lists."""
    given = os.environ.get("DRAFTSMITH_SGLANG_ENV")
    if given:
        if not (Path(given) / COMPLETE).is_file():
            raise RuntimeError(f"DRAFTSMITH_SGLANG_ENV={given} is not a built SGLang test "
                               f"environment (no {COMPLETE}); unset it to build one")
        return Path(given)
    out = cache_dir() / env_key()
    if (out / COMPLETE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:  # one build at a time across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / COMPLETE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            for old in out.parent.iterdir():  # environments of older requirement lists
                if old.is_dir() and old != out and (old / COMPLETE).is_file():
                    shutil.rmtree(old, ignore_errors=True)
    return out


def python_env(env: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a subprocess that imports SGLang (from `env`) and draftsmith."""
    path = os.pathsep.join(p for p in (str(env), str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def source_wheel_file(env: Path, distribution: str, member: str) -> tuple[str, str]:
    """(where, text) of one file inside a downloaded source-only wheel."""
    wheels = sorted((env / WHEELS).glob(f"{distribution.replace('-', '_')}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"{env / WHEELS}: no {distribution} wheel (see {SOURCES.name})")
    with zipfile.ZipFile(wheels[-1]) as wheel, contextlib.suppress(KeyError):
        return f"{wheels[-1].name}:{member}", wheel.read(member).decode()
    raise FileNotFoundError(f"{wheels[-1].name} has no {member}: the fact pinned on it moved")


if __name__ == "__main__":
    print(ensure_env())
