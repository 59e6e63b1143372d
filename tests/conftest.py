"""Shared fixtures: a tiny random-weight target built once per session, offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory) -> Path:
    """A tiny Llama target (random weights, 8 layers, hidden 64) with the demo tokenizer."""
    from draftsmith.tiny_target import build_tiny_target

    out = tmp_path_factory.mktemp("targets") / "random-tiny"
    return build_tiny_target(out, train_steps=0, vocab_size=512, hidden_size=64,
                             intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def random_target(random_target_dir):
    """Descriptor of the random tiny target (what the stages receive)."""
    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    return resolve_target(TargetConfig(model=str(random_target_dir)))


@pytest.fixture(scope="session")
def random_target_model(random_target):
    from draftsmith.target import load_target_model

    return load_target_model(random_target.path)


@pytest.fixture(scope="session")
def random_target_tokenizer(random_target):
    from draftsmith.target import load_tokenizer

    return load_tokenizer(random_target)
