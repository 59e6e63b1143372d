"""The documentation (README.md, docs/, mkdocs.yml) against the code it describes.

- The generated reference pages equal what draftsmith/docs_reference.py makes of the code now,
  and every config field is in the configuration reference with a description.
- Every command in a `bash` block (and every `$ ` line of a `text` block) is run where that is
  cheap (`draftsmith ... --help`, `draftsmith validate` without --deep) and otherwise
  parsed by the real parser of its program: draftsmith's CLI, Prefect's CLI, mkdocs' CLI, a
  script's own argparse parser. A command of a program this file cannot check fails.
- Every `yaml` block validates as a pipeline config; so does every bundled example.
- Links to repository files (root-absolute: /benchmarks/...) name files that exist; images
  exist and stay small; every error class has its section in the troubleshooting page.
- The README stays a front page, and its two commands are the ones CI and a new user run.

docs/contributing.md says the same for whoever writes a page.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib.util
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml

from draftsmith import docs_reference
from draftsmith.config import PipelineConfig, models_in, parse_config

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
DEMO_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && "
                ".venv/bin/draftsmith demo")
GPU_MARK = "# on a GPU host"
README_MAX_LINES = 250
IMAGE_MAX_BYTES = 200 * 1024


# --------------------------------------------------------------------------- reading pages


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, from 1
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page (indented ones in lists too)."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, fence, lang = start.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append(Block(path, i + 1, lang, "\n".join(body)))
        i = j + 1
    return out


def prose(path: Path) -> str:
    """A page without its code blocks and inline code."""
    text = re.sub(r"(?ms)^\s*(`{3,}|~{3,}).*?^\s*\1\s*$", "", path.read_text())
    return re.sub(r"`[^`\n]*`", "", text)


@dataclass(frozen=True)
class Command:
    where: str
    argv: list[str]
    line: str  # the whole logical line, comment included

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name


def commands(block: Block) -> list[Command]:
    """The commands of a block: every logical line of a bash block, `$ ` lines of a text
    block; a line's `&&`, `||`, `;` and `|` separate commands; leading VAR=value are dropped."""
    if block.lang in ("bash", "sh", "shell"):
        lines = block.text.replace("\\\n", " ").splitlines()
    elif block.lang == "text":
        lines = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
    else:
        return []
    out = []
    for line in lines:
        tokens = shlex.split(line, comments=True)
        current: list[str] = []
        for token in [*tokens, ";"]:
            if token in ("&&", "||", ";", "|"):
                while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                    current.pop(0)
                if current:
                    out.append(Command(block.where, current, line))
                current = []
            else:
                current.append(token)
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def all_commands() -> list[Command]:
    return [c for b in all_blocks() for c in commands(b)]


# --------------------------------------------------------------------------- the reference


def test_the_generated_reference_pages_are_current():
    stale = docs_reference.stale_pages()
    assert stale == [], (f"{[str(p.relative_to(REPO)) for p in stale]} differ from the code: "
                         "run python -m draftsmith.docs_reference and commit the pages")


def _fields(model, path=""):
    """Every (section, field name, field) of the config, walked here, not by the generator."""
    for name, field in model.model_fields.items():
        yield path, name, field
        for nested in models_in(field.annotation):
            yield from _fields(nested, docs_reference.child_path(path, name, field))


def test_every_config_field_is_in_the_reference_with_a_description():
    page = (DOCS / "reference" / "configuration.md").read_text()
    tables = {}
    for part in page.split("\n## ")[1:]:
        title, _, body = part.partition("\n")
        tables[title.split(" {#")[0]] = body
    missing, undescribed, count = [], [], 0
    for section, name, field in _fields(PipelineConfig):
        count += 1
        dotted = f"{section}.{name}" if section else name
        if f"| `{name}` |" not in tables.get(section or "top level", ""):
            missing.append(dotted)
        nested = models_in(field.annotation)
        if not field.description and not (nested and docs_reference.docstring(nested[0])):
            undescribed.append(dotted)
    assert missing == [], f"not in docs/reference/configuration.md: {missing}"
    assert undescribed == [], (f"config fields without a description: {undescribed}; give "
                               "each keyed(..., description=...) or operational(..., "
                               "description=...) in draftsmith/config.py")
    assert count >= 160  # the walk reached the nested sections


def test_the_cli_reference_holds_every_command_s_help():
    page = (DOCS / "reference" / "cli.md").read_text()
    for path in docs_reference.cli_commands():
        assert f"## {' '.join(['draftsmith', *path])}\n" in page
        assert docs_reference.cli_help(path) in page


def test_a_stale_page_is_reported_by_the_check(tmp_path, capsys):
    (tmp_path / "configuration.md").write_text("# old\n")
    (tmp_path / "cli.md").write_text(docs_reference.cli_reference())
    with pytest.raises(SystemExit) as stopped:
        docs_reference.main(["--check", "--out", str(tmp_path)])
    assert stopped.value.code == 1
    stderr = capsys.readouterr().err
    assert "configuration.md: stale" in stderr and "cli.md" not in stderr


# --------------------------------------------------------------------------- commands


class Parsed(Exception):
    """argparse parsed a script's arguments: the script stops here, before doing anything."""


def parse_with_argparse(monkeypatch, capsys, run, argv: list[str]) -> str | None:
    """Run a script or module as __main__ until its argparse parser has read `argv`; the
    parser's error, or None."""
    original = argparse.ArgumentParser.parse_args
    capsys.readouterr()  # what earlier commands printed

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        patch.setattr(sys, "argv", argv)
        patch.setattr(sys, "path", list(sys.path))
        try:
            run()
        except Parsed:
            return None
        except SystemExit:
            return capsys.readouterr().err.strip() or "exited while parsing its arguments"
    return "it reads no arguments with argparse, so this test cannot check them"


def check_python(command: Command, monkeypatch, capsys) -> str | None:
    args = command.argv[1:]
    if args[:2] == ["-m", "venv"] or args[:2] == ["-m", "tests.sglang_conformance.env"]:
        return None  # the README's two commands: checked as a whole below
    if args[:2] == ["-m", "pytest"]:
        return None
    if args[0] == "-m":
        spec = importlib.util.find_spec(args[1])
        if spec is None or spec.origin is None:
            return f"no module {args[1]}"
        script, args = Path(spec.origin), [spec.origin, *args[2:]]
    else:
        script = REPO / args[0]
    if not script.is_file():
        return f"{args[0]}: no such script in the repository"
    return parse_with_argparse(monkeypatch, capsys,
                               lambda: runpy.run_path(str(script), run_name="__main__"),
                               [str(script), *args[1:]])


def check_draftsmith(command: Command) -> str | None:
    import typer
    import typer.main
    from typer.testing import CliRunner

    from draftsmith.cli import app

    args = command.argv[1:]
    if "--help" in args or (args[:1] == ["validate"] and "--deep" not in args):
        result = CliRunner().invoke(app, args, prog_name="draftsmith")
        return None if result.exit_code == 0 else (
            f"exited {result.exit_code}: {' '.join(result.output.split())[-500:]}")
    group = typer.main.get_command(app)
    ctx = typer.Context(group, info_name="draftsmith")
    rest = list(args)
    while hasattr(group, "list_commands"):
        if not rest or group.get_command(ctx, rest[0]) is None:
            return f"no command {rest[:1]}; the CLI has {group.list_commands(ctx)}"
        name, rest = rest[0], rest[1:]
        group = group.get_command(ctx, name)
        if hasattr(group, "list_commands"):
            ctx = typer.Context(group, info_name=name, parent=ctx)
    try:
        group.make_context(name, rest, parent=ctx)
    except Exception as err:  # the CLI's own usage errors: unknown option, missing argument
        return f"{type(err).__name__}: {err}"
    return None


def check_prefect(command: Command) -> str | None:
    from prefect.cli._app import _app  # Prefect's cyclopts app: parses without running

    try:
        _app.parse_args(command.argv[1:], exit_on_error=False, print_error=False)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_mkdocs(command: Command) -> str | None:
    from mkdocs.__main__ import cli

    args = command.argv[1:]
    ctx = cli.make_context("mkdocs", list(args[:1]), resilient_parsing=True)
    sub = cli.get_command(ctx, args[0]) if args else None
    if sub is None:
        return f"no mkdocs command {args[:1]}"
    try:
        sub.make_context(args[0], list(args[1:]), parent=ctx)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_pip(command: Command) -> str | None:
    args = command.argv[1:]
    if args[:1] == ["uninstall"]:
        return None
    if args[:1] != ["install"]:
        return f"pip {args[:1]}: only install and uninstall are checked"
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])
    for arg in args[1:]:
        found = re.fullmatch(r"(?:draftsmith)?\.?\[([\w,-]+)\]", arg)
        if found and not set(found.group(1).split(",")) <= extras:
            return f"{arg}: pyproject.toml has the extras {sorted(extras)}"
    return None


def check_bash(command: Command) -> str | None:
    script = REPO / command.argv[1]
    if not script.is_file():
        return f"{command.argv[1]}: no such script in the repository"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    return done.stderr.strip() or None


SIMPLE = {"ruff": ["check", "."], "export": None}  # the test command's ruff; a shell builtin


def check(command: Command, monkeypatch, capsys) -> str | None:
    program = command.program
    if "cuda" in " ".join(command.argv) and GPU_MARK not in command.line:
        return f"mentions cuda but is not marked `{GPU_MARK}`"
    for arg in command.argv[1:]:
        in_repo = re.match(r"(examples|benchmarks|docs|tests)/", arg)
        if in_repo and not arg.startswith("benchmarks/results/") and not (REPO / arg).exists():
            return f"{arg}: no such file in the repository"
    if program in ("python", "python3"):
        return check_python(command, monkeypatch, capsys)
    if program == "draftsmith":
        return check_draftsmith(command)
    if program == "prefect":
        return check_prefect(command)
    if program == "mkdocs":
        return check_mkdocs(command)
    if program == "pip":
        return check_pip(command)
    if program == "bash":
        return check_bash(command)
    if program in SIMPLE:
        want = SIMPLE[program]
        return None if want is None or command.argv[1:] == want else f"{program}: unexpected"
    return f"no check knows the program {program!r}: teach tests/test_docs.py to check it"


def test_every_command_in_the_docs_parses_or_runs(monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the docs' paths are relative to the repository
    found = all_commands()
    assert len(found) > 40  # the blocks were found
    problems = [f"{c.where}: {' '.join(c.argv)}\n    {problem}" for c in found
                if (problem := check(c, monkeypatch, capsys))]
    assert problems == [], "\n".join(problems)


def test_a_wrong_flag_or_missing_argument_is_caught(monkeypatch, capsys):
    """The checks above can fail: each parser refuses what it should."""
    monkeypatch.chdir(REPO)
    block = Block(DOCS / "index.md", 1, "bash", "\n".join([
        "draftsmith run examples/tiny.yaml --epochs 3",
        "draftsmith export /tmp/d --out /tmp/e",
        "prefect worker start --pol gpu",
        "python benchmarks/general/summary.py embedded report.json",
        "python benchmarks/train_throughput.py --device cuda",
        "pip install -e '.[nosuchextra]'",
        "mkdocs build --strictly",
        "docker run x",
    ]))
    problems = [check(c, monkeypatch, capsys) for c in commands(block)]
    assert all(problems), problems
    assert "--epochs" in problems[0] and problems[1].startswith("MissingParameter")
    assert "--pol" in problems[2]
    assert "--drafter" in problems[3] and GPU_MARK in problems[4]


# --------------------------------------------------------------------------- configs


def merged(base: dict, fragment: dict) -> dict:
    out = dict(base)
    for key, value in fragment.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def test_every_yaml_example_in_the_docs_is_a_valid_config():
    tiny = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    found = [b for b in all_blocks() if b.lang == "yaml"]
    assert len(found) >= 8
    for block in found:
        fragment = yaml.safe_load(block.text)
        raw = fragment if "data" in fragment and "run_root" in fragment else merged(tiny,
                                                                                    fragment)
        parse_config(raw, block.where)  # raises naming the block and the key


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_bundled_example_is_a_valid_config(example):
    parse_config(yaml.safe_load(example.read_text()), str(example))


# --------------------------------------------------------------------------- links, images


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_links_to_repository_files_name_files_that_exist():
    broken, count = [], 0
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            path = target.split("#")[0]
            if re.match(r"\w+://|mailto:", target) or not path:
                continue
            if path.startswith("/"):  # root-absolute: a repository file (docs/contributing.md)
                count += 1
                resolved = REPO / path.lstrip("/")
            elif page == README:  # the README is not part of the site: no mkdocs checks it
                resolved = REPO / path
            else:
                continue  # between pages: mkdocs build --strict checks those
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []
    assert count > 10


def test_readme_links_into_the_docs_reach_their_headings():
    from markdown.extensions.toc import slugify

    missing = []
    for target in LINK.findall(prose(README)):
        path, _, anchor = target.partition("#")
        if anchor and path.startswith("docs/"):
            text = (REPO / path).read_text()
            ids = {slugify(h, "-") for h in re.findall(r"^#+ (.+?)\s*$", text, re.M)}
            ids |= set(re.findall(r"\{#([\w-]+)\}", text))
            if anchor not in ids:
                missing.append(target)
    assert missing == []


def test_images_exist_and_stay_small():
    images = [(page, m) for page in DOCS.rglob("*.md")
              for m in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", prose(page))]
    assert images
    for page, image in images:
        path = (page.parent / image).resolve()
        assert path.is_file(), f"{page}: {image}"
        assert path.stat().st_size < IMAGE_MAX_BYTES, (
            f"{path}: too big; python -m tests.ui_screenshots makes small ones")


# --------------------------------------------------------------------------- errors


def error_classes() -> list[str]:
    """Every exception class the code defines (draftsmith/, flows/, tasks/, deployments/,
    blocks/), found in its source."""
    classes: dict[str, list[str]] = {}
    for folder in ("draftsmith", "flows", "tasks", "deployments", "blocks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
    errors = {n for n in vars(builtins) if isinstance(getattr(builtins, n), type)
              and issubclass(getattr(builtins, n), BaseException)}
    found: set[str] = set()
    while True:
        more = {name for name, bases in classes.items()
                if name not in found and any(b in errors or b in found for b in bases)}
        if not more:
            return sorted(found)
        found |= more


def test_every_error_class_has_its_troubleshooting_section():
    page = (DOCS / "troubleshooting.md").read_text()
    sections = set(re.findall(r"^### (\w+)$", page, re.M))
    classes = error_classes()
    assert "ConfigError" in classes and "ReadinessError" in classes
    assert [c for c in classes if c not in sections] == []


# --------------------------------------------------------------------------- the README


def test_the_readme_is_a_front_page_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    test_command = next(line for line in ci if line.startswith("python3 -m venv .venv"))
    readme_commands = [b.text for b in blocks(README) if b.lang == "bash"]
    assert test_command in readme_commands  # the README's test command is CI's
    assert DEMO_COMMAND in readme_commands
    assert "mkdocs build --strict" in test_command
    started = (DOCS / "getting-started.md").read_text()
    assert test_command in started and DEMO_COMMAND in started


def test_lists_are_set_apart_from_the_paragraph_before_them():
    """Python-Markdown (mkdocs) reads a list that follows a paragraph line directly as more
    text of the paragraph: the bullets would show as dashes in one run-on line."""
    glued = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        in_code = False
        for number, (before, line) in enumerate(zip(["", *lines], lines, strict=False), 1):
            if FENCE.match(line):
                in_code = not in_code
            if (not in_code and re.match(r"(- |\d+\. )", line) and before.strip()
                    and not re.match(r"(\s+|- |\d+\. )", before)):
                glued.append(f"{page.relative_to(REPO)}:{number}: {line[:50]}")
    assert glued == [], "put a blank line before each:\n" + "\n".join(glued)


def test_a_section_lists_its_own_fields_before_the_server_fields_it_inherits():
    """pydantic puts a base class's fields first; the reference opens deploy with its engine,
    not with the host and port every server section shares."""
    from draftsmith.config import DeployConfig, VLLMGenerateConfig

    deploy = [name for name, _ in docs_reference.fields_in_reading_order(DeployConfig)]
    assert deploy[0] == "engine" and sorted(deploy) == sorted(DeployConfig.model_fields)
    served = [name for name, _ in docs_reference.fields_in_reading_order(VLLMGenerateConfig)]
    assert served.index("concurrency") < served.index("host")
