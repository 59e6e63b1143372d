"""The GPU-host examples validate where they are meant to run: `draftsmith validate` passes on
examples/vllm-gpu.yaml and examples/kimi-k2.5-8gpu.yaml on a stand-in of the GPU host's files
(the model's config.json with its published shape, data files where the example reads them,
the run root), as the pipeline deployment runs them (orchestration.mode=distributed, which
`draftsmith prefect setup` adds). No weights are read: validate reads only config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from draftsmith.cli import app
from tests.conftest import REPO

# The published shapes (config.json) of the examples' targets: what validate reads.
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
                            "hidden_size": 7168, "num_hidden_layers": 61,
                            "num_attention_heads": 64, "vocab_size": 163840,
                            "max_position_embeddings": 262144}}
DEMO_DATA = {"sharegpt": REPO / "examples" / "data" / "sharegpt.jsonl",
             "openai": REPO / "examples" / "data" / "openai.jsonl"}


def on_the_gpu_host(example: str, host: Path, model_config: dict) -> Path:
    """The example with its absolute paths under `host` (the GPU host's file system): the
    model directory with its config.json, each data file in the example's format."""
    text = (REPO / "examples" / example).read_text()
    for root in ("/mnt/", "/models/"):
        text = text.replace(f" {root}", f" {host}{root}")
    raw = yaml.safe_load(text)
    model = Path(raw["target"]["model"])
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(model_config))
    for source in raw["data"]["sources"]:
        Path(source["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEMO_DATA[source["format"]], source["path"])
    path = host / example
    path.write_text(text)
    return path


def validate(config: Path) -> list[str]:
    result = CliRunner().invoke(app, ["validate", str(config),
                                      "--set", "orchestration.mode=distributed"])
    lines = result.output.splitlines()
    assert result.exit_code == 0, result.output
    assert not [line for line in lines if line.startswith("ERROR")], result.output
    return [" ".join(line.split()) for line in lines]


@pytest.mark.parametrize("example,model_config", [("vllm-gpu.yaml", LLAMA_8B),
                                                  ("kimi-k2.5-8gpu.yaml", KIMI_K25)],
                         ids=["vllm-gpu", "kimi-k2.5-8gpu"])
def test_the_gpu_examples_validate_on_their_host(example, model_config, tmp_path):
    lines = validate(on_the_gpu_host(example, tmp_path, model_config))
    assert any(line.startswith("ok placement: gpu pool: generate, extract, train, deploy, "
                               "benchmark") for line in lines), lines
    if example == "vllm-gpu.yaml":
        assert any("ok aux layers: [1, 15, 28] (outputs; default)" in line and
                   "for vllm on a llama target" in line for line in lines), lines
        assert any("generate on the gpu pool: backend vllm" in line for line in lines)
    else:
        # Outputs of layers 2, 30, 58, written as SGLang's DeepSeek rule reads them.
        assert any("ok aux layers: [2, 30, 58] (outputs; given)" in line and
                   "written [3, 31, 59] for sglang on a deepseek target" in line
                   for line in lines), lines
        assert any("generate on the gpu pool: backend openai at http://127.0.0.1:30000/v1: a "
                   "loopback URL" in line for line in lines), lines
        # The generation server's port is not the drafter server's.
        assert not any(line.startswith("WARNING port") for line in lines), lines
