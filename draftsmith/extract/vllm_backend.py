"""extract.backend=vllm: hidden states from vLLM's own extraction for speculator training.

vLLM 0.32 has a speculative method, `extract_hidden_states`, that makes the target record the
states of the layers named by `eagle_aux_hidden_state_layer_ids` during its forward, and a KV
connector that hands each finished request's states out. draftsmith starts the server with:
- ids = canonical aux ids + 1 (vLLM records the INPUT of layer i, which is the output of layer
  i-1), then L (the last layer's output, before the final norm);
- prefix caching off (a cached prefix is not recomputed, so its states would be missing);
- its connector (draftsmith/extract/vllm_connector.py), which writes one safetensors file per
  request, named by vLLM's request id and returned in the response's kv_transfer_params.

Each sample is sent as its token ids with max_tokens=1. The dump's tokens are checked against
the sample; `final` is the target's final RMSNorm applied to the last layer's output (weights
read from the target's files), the same tensor the transformers backend stores. Shards, receipts
and resume are the transformers backend's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open

from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.extract.store import (
    AsyncShardWriter,
    ShardSpec,
    finished_shard,
    free_disk_bytes,
    gather_shard,
)
from draftsmith.progress import Progress
from draftsmith.serve.process import ManagedProcess
from draftsmith.serve.readiness import wait_for_port

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = "DraftsmithHiddenStatesConnector"
CONNECTOR_MODULE = "draftsmith.extract.vllm_connector"


class VLLMCaptureError(RuntimeError):
    pass


def vllm_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's ids for the canonical aux ids (+1: vLLM records layer inputs), then the last
    layer's output (id L), from which `final` is computed."""
    return [i + 1 for i in aux_ids] + [num_layers]


def build_capture_argv(cfg: ExtractConfig, target_cfg: TargetConfig, model_path: str,
                       layer_ids: list[int], dump_dir: Path) -> tuple[list[str], dict[str, str]]:
    from draftsmith.serve.vllm_launch import vllm_program

    v = cfg.vllm
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {
                       "eagle_aux_hidden_state_layer_ids": layer_ids}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(dump_dir),
                                              "use_synchronization_lock": False}}
    argv = [*(v.vllm_command or vllm_program()), model_path,
            "--host", v.host, "--port", str(v.port),
            "--tensor-parallel-size", str(target_cfg.tp_size), "--dtype", target_cfg.dtype,
            "--no-enable-prefix-caching",  # a cached prefix is not recomputed: states missing
            "--speculative-config", json.dumps(speculative),
            "--kv-transfer-config", json.dumps(transfer)]
    if target_cfg.context_length:
        argv += ["--max-model-len", str(target_cfg.context_length)]
    for flag in ("--enable-prefix-caching", "--speculative-config", "--kv-transfer-config"):
        if flag in v.extra_args:
            raise ValueError(f"extract.vllm.extra_args: {flag} is set by draftsmith for capture")
    argv += v.extra_args
    # The connector module must import in vLLM's processes even from a checkout.
    env = {**v.env, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    return argv, env


def final_norm(target_path: str) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm: its weight (from the safetensors files) and epsilon."""
    config = json.loads((Path(target_path) / "config.json").read_text())
    config = config.get("text_config", config)
    eps = float(config.get("rms_norm_eps", 1e-6))
    for file in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in ("model.norm.weight", "model.language_model.norm.weight"):
                if name in names:
                    return f.get_tensor(name).float(), eps
    raise VLLMCaptureError(f"{target_path}: no model.norm.weight in its safetensors files; the "
                           "vllm backend computes `final` with the target's final RMSNorm")


def apply_rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = states.float()  # [n, H]
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # [n, H]


class VLLMCaptureClient:
    def __init__(self, url: str, model: str, dump_dir: Path, concurrency: int,
                 num_aux: int, hidden: int, norm: tuple[torch.Tensor, float],
                 dump_timeout_s: float):
        self.url, self.model, self.dump_dir = url, model, dump_dir
        self.concurrency, self.num_aux, self.hidden = concurrency, num_aux, hidden
        self.norm, self.dump_timeout_s = norm, dump_timeout_s
        self.client = httpx.Client(base_url=url, timeout=httpx.Timeout(600.0))

    def close(self) -> None:
        self.client.close()

    def _wait_for(self, path: Path, sample_id: str) -> None:
        deadline = time.monotonic() + self.dump_timeout_s
        while not path.is_file():
            if time.monotonic() > deadline:
                raise VLLMCaptureError(
                    f"sample {sample_id}: answered, but {path} did not appear within "
                    f"{self.dump_timeout_s:.0f}s (is the dump directory local to the server?)")
            time.sleep(0.005)

    def capture(self, sample_id: str, input_ids: list[int]) -> dict[str, torch.Tensor]:
        response = self.client.post("/v1/completions", json={
            "model": self.model, "prompt": input_ids, "max_tokens": 1, "temperature": 0.0})
        if response.status_code != 200:
            raise VLLMCaptureError(f"sample {sample_id}: /v1/completions answered "
                                   f"{response.status_code}: {response.text[:300]}")
        params = response.json().get("kv_transfer_params") or {}
        if "hidden_states_path" not in params:
            raise VLLMCaptureError(f"sample {sample_id}: the response has no "
                                   "kv_transfer_params.hidden_states_path: is the server running "
                                   f"with draftsmith's capture connector? ({response.text[:200]})")
        path = Path(params["hidden_states_path"])
        self._wait_for(path, sample_id)
        with safe_open(str(path), framework="pt") as f:
            states, tokens = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        path.unlink(missing_ok=True)
        n = len(input_ids)
        if tokens.tolist() != input_ids:
            raise VLLMCaptureError(f"sample {sample_id}: {path.name} holds other tokens than "
                                   "the request")
        if tuple(states.shape) != (n, self.num_aux + 1, self.hidden):
            raise VLLMCaptureError(f"sample {sample_id}: states of shape {tuple(states.shape)}, "
                                   f"expected ({n}, {self.num_aux + 1}, {self.hidden})")
        weight, eps = self.norm
        return {"input_ids": tokens.long(),  # [n]
                "aux": states[:, : self.num_aux].reshape(n, -1),  # [n, K*H]
                "final": apply_rms_norm(states[:, self.num_aux], weight, eps)}  # [n, H]

    def capture_shard(self, spec: ShardSpec, rows: dict[str, dict], store_dtype,
                      pool: ThreadPoolExecutor) -> dict[str, Any]:
        return gather_shard(self.capture, spec, rows, store_dtype, pool)


def run_vllm_capture(cfg: ExtractConfig, target_cfg: TargetConfig, target, out: Path,
                     specs: list[ShardSpec], rows: dict[str, list[dict]],
                     aux_ids: list[int]) -> dict[str, Any]:
    from draftsmith.extract.sglang_backend import default_dump_dir
    from draftsmith.serve.vllm_launch import STARTUP_FIXES
    from draftsmith.target import DTYPES

    v = cfg.vllm
    num_layers, hidden = target.figures["num_layers"], target.figures["hidden_size"]
    layer_ids = vllm_layer_ids(aux_ids, num_layers)
    dump_dir = Path(v.dump_dir) if v.dump_dir else default_dump_dir(out)
    dump_dir.mkdir(parents=True, exist_ok=True)
    argv, env = build_capture_argv(cfg, target_cfg, target.path, layer_ids, dump_dir)
    server_log = out / ".capture-server.log"  # a dot name: out of the stage's fingerprint
    log.info("extract: starting the vLLM capture server (log %s): %s", server_log,
             " ".join(argv))
    process = ManagedProcess(argv, server_log, env=env, name="vllm-capture").start()
    url = f"http://{v.host}:{v.port}"
    try:
        wait_for_port(v.host, v.port, process, v.startup_timeout_s, fixes=STARTUP_FIXES)
        if httpx.get(f"{url}/health", timeout=60).status_code != 200:
            raise VLLMCaptureError(f"{url}/health did not answer 200")
        client = VLLMCaptureClient(url, target.path, dump_dir, v.concurrency, len(aux_ids),
                                   hidden, final_norm(target.path), v.dump_timeout_s)
        by_id = {r["id"]: r for split_rows in rows.values() for r in split_rows}
        pending = [s for s in specs if finished_shard(out, s) is None]
        progress = Progress("extract (vllm)", total=sum(s.num_tokens for s in pending),
                            unit="token")
        writer = AsyncShardWriter(out, max_pending=cfg.writer_queue, threads=cfg.writer_threads)
        started = time.monotonic()  # the server is up: its start-up is not capture time
        try:
            with ThreadPoolExecutor(max_workers=v.concurrency) as pool:
                for spec in pending:
                    tensors = client.capture_shard(spec, by_id, DTYPES[cfg.dtype], pool)
                    writer.submit(spec, lambda t=tensors: t)
                    progress.update(spec.num_tokens,
                                    written=f"{writer.bytes_written / 2**30:.2f} GiB",
                                    free_disk=f"{free_disk_bytes(out) / 2**30:.1f} GiB")
        finally:
            writer.close()
            client.close()
        progress.close()
        return {"shards": len(pending), "tokens": sum(s.num_tokens for s in pending),
                "seconds": time.monotonic() - started, "skipped": len(specs) - len(pending)}
    finally:
        process.stop()

