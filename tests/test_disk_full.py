"""A disk that fills up during a stage, on a real filesystem: a small tmpfs.

tests/disk_full_child.py runs generate -> merge -> extract -> train -> export on the random tiny
target once on a roomy disk and once with its run root on a 32 MiB tmpfs, mounted in a mount
namespace of its own (`unshare --mount` as root, as CI runs; `unshare --user --map-root-user
--mount` otherwise, where the kernel allows user namespaces). On the tmpfs, a file fills the
disk at one moment of each stage, after the stage's preflight: after the first answers are
journaled, before merge writes, after the first shard, after the first checkpoint, before the
training chart and before its manifest, before the export. Every failure here is the kernel's
ENOSPC (nothing is injected); then the filler is deleted and the stage runs again.

What a user relies on: the error names the file (or the stage directory), the bytes and the
fix; nothing half-written is left where a later run would take it for finished; the rerun
resumes from the last complete answer, shard or checkpoint; the outputs are identical to the
roomy run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SIZE = "32m"


def in_small_filesystem(argv: list[str], mount, timeout_s: float) -> subprocess.CompletedProcess:
    """Run argv in a mount namespace of its own, in which `mount` is a tmpfs of SIZE."""
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    script = f'mount -t tmpfs -o size={SIZE} draftsmith-test "$0" && exec "$@"'
    return subprocess.run([*unshare, "sh", "-c", script, str(mount), *argv],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


@pytest.fixture(scope="module")
def report(tmp_path_factory, random_target_dir) -> dict:
    root = tmp_path_factory.mktemp("disk-full")
    (root / "small").mkdir()
    done = in_small_filesystem(
        [sys.executable, str(REPO / "tests" / "disk_full_child.py"), "--target",
         str(random_target_dir), "--roomy", str(root / "roomy"), "--disk", str(root / "small")],
        root / "small", timeout_s=900)
    assert done.returncode == 0, (
        "the disk-full pipeline failed (it needs a tmpfs in a mount namespace: root, or user "
        f"namespaces enabled):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fault(report: dict, stage: str, index: int = 0) -> dict:
    return report["stages"][stage]["faults"][index]


def test_the_disk_is_a_real_small_filesystem(report):
    fs = report["filesystem"]
    assert fs["type"] == "tmpfs" and fs["bytes"] <= 32 << 20, fs


def assert_clear_error(entry: dict, run_root_part: str) -> None:
    """The error a user gets: ENOSPC, the path, the bytes, the free space, the fix."""
    text = entry["error"]
    assert text is not None, "the stage did not fail on a full disk"
    assert entry["errno"] == 28
    assert text.startswith("disk full: writing") and "[Errno 28] No space left on device" in text
    assert entry["path"] in text and run_root_part in entry["path"]
    assert "free of" in text and "Free space there (or point run_root at a bigger disk)" in text
    assert "resumes from its last complete" in text
    assert not entry["complete"], "a stage that failed has a manifest"
    assert entry["temp_files"] == [], "a half-written temp file was left behind"


@pytest.mark.parametrize("stage", ["generate", "merge", "extract", "train", "export"])
def test_after_space_is_freed_the_outputs_are_those_of_a_roomy_disk(report, stage):
    entry = report["stages"][stage]
    assert entry["small"] == entry["roomy"] and entry["small"], stage
    assert entry["temp_files_after"] == []


def test_the_generate_journal_fails_whole_lines_and_the_rerun_asks_only_the_rest(report):
    entry = fault(report, "generate")
    assert_clear_error(entry, "/generate/answers/")
    assert entry["path"].endswith(".jsonl") and "writing the journal" in entry["error"]
    assert "it needed" in entry["error"] and "bytes" in entry["error"]
    # The answers journaled before the disk filled, whole (the appends that still found room
    # in a journal's last page, too), the one that found none taken back.
    journals = entry["journal"]
    assert journals and all(j["ends_whole"] and j["all_parse"] for j in journals.values())
    answered = sum(j["lines"] for j in journals.values())
    assert 8 <= answered < 32, journals
    assert any(f"{answered} of 32 prompts answered before" in line
               for line in report["stages"]["generate"]["rerun_log"])


def test_merge_names_its_directory(report):
    entry = fault(report, "merge")
    assert_clear_error(entry, "/merge/")
    assert "merge's output in" in entry["error"]


def test_extract_keeps_every_finished_shard_and_resumes_from_them(report):
    entry = fault(report, "extract")
    assert_clear_error(entry, "/extract/")
    assert entry["path"].endswith(".safetensors")
    assert "it needed" in entry["error"]
    shards = entry["receipted_shards"]
    assert shards and all(shards.values()), shards  # each receipted shard is whole
    rerun = report["stages"]["extract"]["rerun_log"]
    assert any(f"resuming, {len(shards)} of 3 shards already complete" in line
               for line in rerun), rerun


def test_a_checkpoint_that_does_not_fit_keeps_the_one_before(report):
    entry = fault(report, "train")
    assert_clear_error(entry, "/train/")
    assert entry["path"].endswith("resume/state.pt") and "it needed" in entry["error"]
    assert entry["checkpoint"] == {"loads": True, "step": 2}


def test_a_full_disk_when_training_ends_costs_no_training(report):
    """The chart and then the manifest, written after the last step: the last checkpoint
    stays until the manifest is written, so the rerun resumes at the last step and trains
    none again."""
    chart, manifest = fault(report, "train", 1), fault(report, "train", 2)
    assert_clear_error(chart, "/train/")
    assert "train's output in" in chart["error"]
    assert_clear_error(manifest, "/train/")
    assert manifest["path"].endswith("/manifest.json") and "it needed" in manifest["error"]
    last = manifest["checkpoint"]
    assert last["loads"] and last["step"] > 2 and chart["checkpoint"] == last
    rerun = report["stages"]["train"]["rerun_log"]
    assert any(f"at step {last['step']} " in line and "resuming from" in line
               for line in rerun), rerun


def test_export_names_the_drafter_file(report):
    entry = fault(report, "export")
    assert_clear_error(entry, "/export/")
    assert entry["path"].endswith(".safetensors") and "it needed" in entry["error"]
