"""Preflight of GPU stages: busy GPUs are named with their processes, disk room is checked."""

from __future__ import annotations

import os
import shutil

import pytest

from draftsmith import preflight
from draftsmith.artifacts import StagePlan
from draftsmith.serve.gpus import GpusBusyError
from tests.conftest import REPO


@pytest.fixture()
def held_gpu(tmp_path, monkeypatch):
    """nvidia-smi that shows GPU 0 held by nv-hostengine until asked once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(REPO / "tests" / "fake_nvidia_smi.sh", bin_dir / "nvidia-smi")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPU_RELEASED", str(tmp_path / "released"))
    return tmp_path / "released"


def plan(tmp_path, stage="extract") -> StagePlan:
    return StagePlan(stage=stage, key="k", path=str(tmp_path / "runs" / stage / "k"))


def test_a_held_gpu_fails_the_stage_naming_the_holder_and_a_later_check_passes(
        tmp_path, held_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(GpusBusyError, match=r"(?s)extract: GPUs 0 must be free.*"
                                            r"GPU 0: pid 4242 nv-hostengine \(512 MiB\)"):
        preflight.check_stage(plan(tmp_path), "cpu")
    preflight.check_stage(plan(tmp_path), "cpu")  # released: a retry goes through


def test_gpus_outside_the_stage_s_devices_do_not_block_it(tmp_path, held_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    preflight.check_stage(plan(tmp_path), "cuda")
    assert held_gpu.exists()  # it did ask nvidia-smi, and GPU 0's holder is not in its way


def test_a_cpu_stage_without_visible_devices_does_not_ask_for_gpus(tmp_path, held_gpu,
                                                                   monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    preflight.check_stage(plan(tmp_path), "cpu")
    assert not held_gpu.exists()
    with pytest.raises(GpusBusyError, match="all GPUs must be free"):
        preflight.check_stage(plan(tmp_path), "cuda:0")


def test_not_enough_disk_names_the_need_and_the_fix(tmp_path):
    with pytest.raises(preflight.PreflightError,
                       match=r"(?s)extract: needs about .* GiB under .*extract.*free space there"):
        preflight.check_stage(plan(tmp_path), "cpu", needed_bytes=1 << 60)


