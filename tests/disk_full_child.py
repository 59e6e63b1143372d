"""A pipeline whose disk fills up under each writer, then is freed (tests/test_disk_full.py).

Runs generate -> merge -> extract -> train -> export on the random tiny target twice through the
stage table's own entry (`Stage.execute`, what the Prefect task calls after its preflight):
once into a roomy directory, then with its run root on a small tmpfs (the test starts this
script in a mount namespace where it is mounted). There, a file fills the filesystem at one
moment of each stage, as another process on a shared host would, after the preflight: after
the first answers are journaled, before merge writes, after the first shard, after the first
checkpoint, before the training chart, before training's manifest, before the export. The
stage then fails on a real ENOSPC. The filler is deleted and the stage run again. Prints one
JSON report: per fault, the error, what was left on disk, what the rerun resumed from, and the
checksums of the outputs on both disks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftsmith import stages  # noqa: E402
from draftsmith.artifacts import MANIFEST, read_descriptor  # noqa: E402
from draftsmith.config import parse_config  # noqa: E402
from draftsmith.diskspace import DiskFullError, free_bytes  # noqa: E402
from draftsmith.export.stage import drafter_dir_name  # noqa: E402
from draftsmith.plan import stage_plan  # noqa: E402
from draftsmith.target import resolve_target  # noqa: E402
from tests.conftest import REPO, TRAIN_INPUT_SECTIONS, TRAIN_INPUT_SOURCES  # noqa: E402

# What each stage's output is compared on (timings, which differ run to run, left out).
COMPARED = {"generate": ("records.jsonl",), "merge": None, "extract": (".safetensors",),
            "train": ("drafter.safetensors",), "export": (drafter_dir_name("eagle3") + "/",)}
FILLER = ".filler"


class Disk:
    """The small filesystem mounted at `root`: fill it up to `leave` free bytes, free it."""

    def __init__(self, root: Path):
        self.root = root
        self.filler = root / FILLER

    def fill(self, leave: int = 0) -> None:
        chunk = b"\0" * (64 << 10)
        with open(self.filler, "ab") as f:
            while free_bytes(self.root) > leave:
                want = min(len(chunk), free_bytes(self.root) - leave)
                try:
                    f.write(chunk[:max(want, 1)])
                    f.flush()
                except OSError:
                    break

    def release(self) -> None:
        self.filler.unlink(missing_ok=True)


def config_for(run_root: Path, target: str):
    raw = {"run_root": str(run_root), "target": {"model": target},
           "data": {"sources": TRAIN_INPUT_SOURCES}, **TRAIN_INPUT_SECTIONS,
           "train": {"ttt_steps": 2, "lr": 3e-3, "epochs": 2, "batch_tokens": 128,
                     "log_every": 1, "checkpoint_every": 2}}
    return parse_config(raw, "disk_full_child")


def checksums(descriptor, stage: str) -> dict[str, str]:
    """sha256 of the stage's compared files."""
    files = json.loads((descriptor.dir / MANIFEST).read_text())["files"]
    wanted = COMPARED[stage]
    return {name: digest for name, digest in files.items()
            if wanted is None or any(name.endswith(w) or name.startswith(w) for w in wanted)}


def temp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp"))


@contextmanager
def wrapped(obj, name: str, wrap):
    """obj.name replaced by wrap(obj.name) for the block."""
    real = getattr(obj, name)
    setattr(obj, name, wrap(real))
    try:
        yield
    finally:
        setattr(obj, name, real)


def filled_after(obj, name: str, disk: Disk, calls: int, leave: int):
    """Fill the disk (to `leave` bytes free) right after the `calls`-th call of obj.name."""
    count = {"n": 0}

    def wrap(real):
        def wrapper(*args, **kwargs):
            result = real(*args, **kwargs)
            count["n"] += 1
            if count["n"] == calls:
                disk.fill(leave)
            return result
        return wrapper

    return wrapped(obj, name, wrap)


def filled_before(obj, name: str, disk: Disk, leave: int):
    """Fill the disk right before the first call of obj.name."""

    def wrap(real):
        def wrapper(*args, **kwargs):
            disk.fill(leave)
            return real(*args, **kwargs)
        return wrapper

    return wrapped(obj, name, wrap)


def filled_before_second(obj, name: str, disk: Disk, leave: int):
    """Fill the disk once the first call of obj.name has returned, before the second goes on
    (shards are written on two threads: the second one waits for the first)."""
    first_done, lock, count = threading.Event(), threading.Lock(), {"n": 0}

    def wrap(real):
        def wrapper(*args, **kwargs):
            with lock:
                count["n"] += 1
                mine = count["n"]
            if mine == 1:
                try:
                    return real(*args, **kwargs)
                finally:
                    first_done.set()
            first_done.wait()
            if mine == 2:
                disk.fill(leave)
            return real(*args, **kwargs)
        return wrapper

    return wrapped(obj, name, wrap)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--roomy", required=True)
    parser.add_argument("--disk", required=True, help="the small filesystem's mount point")
    args = parser.parse_args()
    from draftsmith.data import merge
    from draftsmith.export import stage as export
    from draftsmith.extract import store
    from draftsmith.generate.journal import Journal
    from draftsmith.train import charts, trainer
    from draftsmith.train.checkpoint import DDPCheckpointer

    lines = Lines()
    logging.getLogger("draftsmith").addHandler(lines)
    logging.getLogger("draftsmith").setLevel(logging.INFO)
    disk = Disk(Path(args.disk))
    run_root = disk.root / "run"
    roomy, small = config_for(Path(args.roomy), args.target), config_for(run_root, args.target)
    target = resolve_target(roomy.target)
    # The fault of each stage: where the disk fills up, and how much stays free then.
    faults = {
        "generate": [lambda: filled_after(Journal, "add_answer", disk, calls=8, leave=0)],
        "merge": [lambda: filled_before(merge, "run_merge", disk, leave=0)],
        "extract": [lambda: filled_before_second(store, "write_shard", disk, leave=16 << 10)],
        "train": [lambda: filled_after(DDPCheckpointer, "_save", disk, calls=1,
                                       leave=64 << 10),
                  lambda: filled_before(charts, "plot_metrics", disk, leave=0),
                  lambda: filled_before(trainer, "finish_stage", disk, leave=0)],
        "export": [lambda: filled_before(export, "run_export", disk, leave=16 << 10)],
    }
    report: dict = {"filesystem": filesystem(disk.root), "stages": {}}
    outputs = {name: {stages.TARGET: target} for name in ("roomy", "small")}
    for name in ("generate", "merge", "extract", "train", "export"):
        stage = stages.get(name)
        roomy_plan = stage_plan(roomy, name, outputs["roomy"])
        done = stage.execute(roomy, {i: outputs["roomy"][i] for i in stage.stage_inputs()},
                             roomy_plan)
        outputs["roomy"][name] = done
        entry = report["stages"][name] = {"faults": [], "roomy": checksums(done, name)}
        inputs = {i: outputs["small"][i] for i in stage.stage_inputs()}
        plan = stage_plan(small, name, outputs["small"])
        for fault in faults[name]:
            del lines.lines[:]
            try:
                with fault():
                    stage.execute(small, inputs, plan)
                error = None
            except DiskFullError as err:
                error = err
            entry["faults"].append({
                "error": str(error) if error else None, "errno": getattr(error, "errno", None),
                "path": getattr(error, "filename", None),
                "free_when_failed": free_bytes(disk.root),
                "complete": (plan.dir / MANIFEST).is_file(),
                "temp_files": temp_files(disk.root),
                "journal": journal_state(run_root),
                "receipted_shards": receipted(plan.dir),
                "checkpoint": checkpoint_state(plan.dir)})
            disk.release()
        del lines.lines[:]
        # The rerun, with room again (a fault that did not fail the stage left it complete).
        done = read_descriptor(plan) if plan.is_complete() else \
            stage.execute(small, inputs, plan)
        outputs["small"][name] = done
        entry.update(small=checksums(done, name), rerun_log=list(lines.lines),
                     temp_files_after=temp_files(disk.root))
    print(json.dumps(report))


def filesystem(path: Path) -> dict:
    """The filesystem holding `path`, as the kernel lists it, and its size."""
    best = ("", "")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        device, point, kind = line.split()[:3]
        if str(path).startswith(point) and len(point) >= len(best[0]):
            best = (point, kind)
    stat = os.statvfs(path)
    return {"mount": best[0], "type": best[1], "bytes": stat.f_blocks * stat.f_frsize}


def journal_state(run_root: Path) -> dict:
    """Per journal file: its lines, and whether each is whole JSON."""
    out = {}
    for path in sorted((run_root / "generate").glob("answers/*/answers*.jsonl")):
        data = path.read_bytes()
        rows = data.split(b"\n")
        whole = data.endswith(b"\n") or not data
        parsed = True
        for row in rows[:-1]:
            try:
                json.loads(row)
            except ValueError:
                parsed = False
        out[str(path.relative_to(run_root))] = {"lines": len(rows) - 1, "ends_whole": whole,
                                                "all_parse": parsed}
    return out


def receipted(directory: Path) -> dict[str, bool]:
    """Each shard with a receipt: whether the file matches its receipted size and sha256."""
    out = {}
    for receipt in sorted((directory / ".receipts").glob("*.json")):
        record = json.loads(receipt.read_text())
        path = directory / record["file"]
        out[record["file"]] = path.is_file() and path.stat().st_size == record["bytes"] and \
            hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"]
    return out


def checkpoint_state(directory: Path) -> dict | None:
    """The resume checkpoint, if any: whether it loads, and at which step."""
    path = directory / "resume" / "state.pt"
    if not path.is_file():
        return None
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - the report says what is wrong with it
        return {"loads": False, "error": str(err)}
    return {"loads": True, "step": saved["position"]["step"]}


if __name__ == "__main__":
    os.chdir(REPO)
    main()
