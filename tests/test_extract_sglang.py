"""The SGLang capture backend without a GPU SGLang: the capture hook inside a stand-in for
SGLang's Llama (same calling convention: aux = inputs of `layers_to_capture`, logits processor
called with every token's final and aux states, as a list or packed, with or without
input_ids), a stand-in HTTP server that batches concurrent requests in shuffled order, and the
launch command. SGLang's own registry loading the capture package is in
tests/test_sglang_conformance.py."""

from __future__ import annotations

import random
import sys
import threading
import time
import types
from http.server import ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from draftsmith.artifacts import plan_stage
from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.extract.capture import HiddenStateCapture
from draftsmith.extract.sglang_backend import (
    EXTERNAL_PACKAGE,
    CaptureError,
    build_capture_launch,
    check_capturable,
)
from draftsmith.extract.sglang_dump import (
    ENV_ARCH,
    ENV_DIR,
    ENV_LAYERS,
    CaptureLogitsProcessor,
    install_capture,
)
from draftsmith.extract.stage import run_extract
from draftsmith.extract.store import ShardReader
from tests.json_http import JsonHandler
from tests.ports import free_port
from tests.test_extract_stage import make_merged

AUX_IDS = [1, 3, 4]


class ForwardMode:
    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend

    def is_target_verify(self) -> bool:
        return False


class SGLangStyleDecoder(torch.nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model
        self.layers = hf_model.model.layers
        self.layers_to_capture: list[int] = []
        self.capture_aux_hidden_states = False


class SGLangStyleLlama(torch.nn.Module):
    """What SGLang's LlamaForCausalLM does around the logits processor, on a transformers
    Llama: a ragged batch of requests, aux = the INPUT of each layer in layers_to_capture.
    style "packed": aux handed over as one [N, K*H] tensor, as DeepseekV2/V3 do with
    AuxHiddenStatePacker; "kimi": also input_ids=None, the tokens in forward_batch.input_ids,
    as Kimi-K2.5 calls its DeepSeek model through mm_utils."""

    def __init__(self, hf_model, style: str = "list"):
        super().__init__()
        self.style = style
        self.model = SGLangStyleDecoder(hf_model)
        self.lm_head = hf_model.lm_head
        self.logits_processor = LastTokenLogits()
        self.capture_aux_hidden_states = False

    @torch.inference_mode()
    def forward(self, requests: list[list[int]], rids: list[str] | None):
        finals, auxes = [], []
        for ids in requests:
            seen: dict[int, torch.Tensor] = {}
            handles = [self.model.layers[j].register_forward_pre_hook(
                lambda _m, args, kwargs, j=j, seen=seen: seen.__setitem__(
                    j, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
                for j in self.model.layers_to_capture]
            try:
                out = self.model.hf.model(input_ids=torch.tensor([ids]))
            finally:
                for h in handles:
                    h.remove()
            finals.append(out.last_hidden_state[0])  # [T, H] after the final norm
            auxes.append([seen[j][0] for j in self.model.layers_to_capture])
        tokens = torch.tensor([t for r in requests for t in r])  # [N]
        batch = types.SimpleNamespace(forward_mode=ForwardMode(True), input_ids=tokens,
                                      extend_seq_lens_cpu=[len(r) for r in requests],
                                      extend_prefix_lens_cpu=[0] * len(requests))
        if rids is not None:
            batch.rids = rids
        aux = None
        if self.capture_aux_hidden_states:
            aux = [torch.cat([a[k] for a in auxes]) for k in range(len(auxes[0]))]  # K x [N, H]
            if self.style in ("packed", "kimi"):
                aux = torch.cat(aux, dim=-1)  # [N, K*H]
        return self.logits_processor(None if self.style == "kimi" else tokens,
                                     torch.cat(finals), self.lm_head, batch, aux)


class LastTokenLogits(torch.nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        if not forward_batch.forward_mode.is_extend():  # decode: one token per request
            return hidden_states @ lm_head.weight.T  # [B, V]
        ends = torch.tensor(forward_batch.extend_seq_lens_cpu).cumsum(0) - 1  # [B]
        return hidden_states[ends] @ lm_head.weight.T  # [B, V]


@pytest.mark.parametrize("style", ["list", "packed", "kimi"])
def test_capture_hook_dumps_the_same_states_as_the_transformers_backend(
        tmp_path, random_target_model, random_target, style):
    model = SGLangStyleLlama(random_target_model, style)
    writer = install_capture(model, AUX_IDS, tmp_path)
    assert model.model.layers_to_capture == [2, 4, 5]  # inputs of i+1 = outputs of i
    assert isinstance(model.logits_processor, CaptureLogitsProcessor)
    g = torch.Generator().manual_seed(0)
    V = random_target.figures["vocab_size"]
    requests = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 12, 3)]
    logits = model(requests, ["a", "b", "c"])
    writer.close()
    assert logits.shape == (3, V)  # the server still answers as before
    reference = HiddenStateCapture(random_target_model, AUX_IDS)
    from safetensors.torch import load_file

    for rid, ids in zip("abc", requests, strict=True):
        dump = load_file(str(tmp_path / f"rid-{rid}.safetensors"))
        aux, final = reference(torch.tensor([ids]), None)
        assert dump["input_ids"].tolist() == ids
        torch.testing.assert_close(dump["aux"], aux[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dump["final"], final[0], rtol=1e-5, atol=1e-6)


def test_decode_steps_write_nothing(tmp_path, random_target_model):
    model = SGLangStyleLlama(random_target_model)
    writer = install_capture(model, AUX_IDS, tmp_path)
    batch = types.SimpleNamespace(forward_mode=ForwardMode(False), extend_seq_lens_cpu=None)
    hidden = torch.zeros(2, 64)
    model.logits_processor(torch.tensor([1, 2]), hidden, model.lm_head, batch,
                           [hidden, hidden, hidden])
    writer.close()
    assert not list(tmp_path.glob("*.safetensors"))


def test_last_layer_cannot_be_captured_by_sglang():
    check_capturable([1, 3, 6], 8)
    with pytest.raises(ValueError, match="largest id is 6"):
        check_capturable([1, 3, 7], 8)


# --------------------------------------------------------------------------- stand-in server

class StandInServer:
    """Collects concurrent /generate requests for a short window, runs them as one batch in
    shuffled order through the SGLang-style model, answers in random order."""

    def __init__(self, model, mode: str = "rids", host: str = "127.0.0.1", port: int = 0):
        self.model, self.mode = model, mode
        self.pending: list[tuple[dict, threading.Event]] = []
        self.lock = threading.Lock()
        self.batch_sizes: list[int] = []
        self.info = {"version": "0.5.23", "attn_dp_size": 1, "disable_radix_cache": True,
                     "chunked_prefill_size": -1}
        server = self

        class Handler(JsonHandler):

            def do_GET(self):
                if self.path == "/server_info":  # the fields SGLang 0.5.23 reports
                    self.send_json(200, server.info)
                else:
                    self.send_json(200 if self.path == "/health" else 404, {})

            def do_POST(self):
                body = self.read_json()
                assert body["sampling_params"]["max_new_tokens"] == 1
                done = threading.Event()
                with server.lock:
                    server.pending.append((body, done))
                done.wait(60)
                time.sleep(random.random() * 0.01)
                self.send_json(200, {"meta_info": {"id": body["rid"], "completion_tokens": 1}})

        self.http = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.http.server_address[1]}"
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.http.serve_forever, daemon=True),
                        threading.Thread(target=self._batcher, daemon=True)]

    def _batcher(self) -> None:
        rng = random.Random(0)
        while not self.stop.is_set():
            time.sleep(0.02)
            with self.lock:
                batch, self.pending = self.pending, []
            if not batch:
                continue
            rng.shuffle(batch)
            self.batch_sizes.append(len(batch))
            rids = [b["rid"] for b, _ in batch]
            if self.mode == "swapped" and len(rids) > 1:
                rids = rids[1:] + rids[:1]  # the seeds' bug: dumps handed to the wrong requests
            self.model([b["input_ids"] for b, _ in batch],
                       None if self.mode == "no_rids" else rids)
            for _, done in batch:
                done.set()

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.http.shutdown()


@pytest.fixture
def merged_small(tmp_path, random_target):
    return make_merged(tmp_path / "merged", 24, 4, random_target.figures["vocab_size"], seed=3)


def sglang_extract(root, merged, target, url, dump_dir, dump_timeout_s=10):
    cfg = ExtractConfig(backend="sglang", shard_tokens=150, sglang={
        "url": url, "dump_dir": str(dump_dir), "concurrency": 8,
        "dump_timeout_s": dump_timeout_s})
    plan = plan_stage(root, "extract", {"sglang": 1}, [merged, target])
    return run_extract(cfg, TargetConfig(model=target.path), merged, target, plan)


@pytest.mark.parametrize("mode", ["rids", "no_rids"])
def test_concurrent_requests_get_their_own_states(tmp_path, merged_small, random_target,
                                                  random_target_model, mode):
    model = SGLangStyleLlama(random_target_model)
    dumps = tmp_path / "dumps"
    writer = install_capture(model, AUX_IDS, dumps)
    with StandInServer(model, mode) as server:
        descriptor = sglang_extract(tmp_path / "run", merged_small, random_target, server.url,
                                    dumps)
    writer.close()
    assert max(server.batch_sizes) > 1, "requests were never batched together"
    reader = ShardReader(descriptor.path)
    assert len(reader) == 28 and reader.aux_layer_ids == AUX_IDS
    reference = HiddenStateCapture(random_target_model, AUX_IDS)
    rows = pq.read_table(Path(merged_small.path) / "train.parquet").to_pylist()
    for row in rows:
        sample = reader.sample(row["id"])
        aux, final = reference(torch.tensor([row["input_ids"]]), None)
        assert sample.input_ids.tolist() == row["input_ids"]
        assert sample.loss_mask.tolist() == row["loss_mask"]
        torch.testing.assert_close(sample.aux, aux[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sample.final, final[0], rtol=1e-5, atol=1e-6)
    assert not list(dumps.glob("*.safetensors")), "dumps are deleted once stored"


def test_a_dump_of_another_request_is_refused(tmp_path, merged_small, random_target,
                                              random_target_model):
    model = SGLangStyleLlama(random_target_model)
    dumps = tmp_path / "dumps"
    writer = install_capture(model, AUX_IDS, dumps)
    with StandInServer(model, "swapped") as server, pytest.raises(CaptureError,
                                                                  match="other tokens"):
        sglang_extract(tmp_path / "run", merged_small, random_target, server.url, dumps)
    writer.close()


# --------------------------------------------------------------------------- the probe


def test_probe_stops_before_bulk_capture_when_no_dump_comes(tmp_path, merged_small,
                                                            random_target, random_target_model):
    """A server without the capture package (SGLang only warns when it fails to import):
    one request, then a clear stop, instead of every sample timing out."""
    model = SGLangStyleLlama(random_target_model)  # the stock class: no capture installed
    with StandInServer(model) as server, pytest.raises(CaptureError) as err:
        sglang_extract(tmp_path / "run", merged_small, random_target, server.url,
                       tmp_path / "dumps", dump_timeout_s=2)
    assert "capture probe failed before bulk capture" in str(err.value)
    assert "does not run draftsmith's capture package" in str(err.value)
    assert sum(server.batch_sizes) == 1  # the probe alone


def test_probe_refuses_a_server_capturing_other_layers(tmp_path, merged_small, random_target,
                                                      random_target_model):
    """Same width, other layers (a server started for another config): without the probe
    this trains on the wrong hidden states, silently."""
    model = SGLangStyleLlama(random_target_model)
    dumps = tmp_path / "dumps"
    writer = install_capture(model, [1, 2, 4], dumps)
    with StandInServer(model) as server, pytest.raises(CaptureError,
                                                      match="inputs of layers 2,3,5, not 2,4,5"):
        sglang_extract(tmp_path / "run", merged_small, random_target, server.url, dumps)
    writer.close()


@pytest.mark.parametrize(("info", "message"), [
    ({"attn_dp_size": 8}, "runs attention data parallel"),
    ({"version": "0.5.9"}, "runs SGLang 0.5.9; draftsmith supports SGLang >=0.5.23,<0.6"),
])
def test_a_capture_server_that_cannot_capture_is_refused_before_any_request(
        tmp_path, merged_small, random_target, random_target_model, info, message):
    model = SGLangStyleLlama(random_target_model)
    writer = install_capture(model, AUX_IDS, tmp_path / "dumps")
    with StandInServer(model) as server, pytest.raises(CaptureError, match=message):
        server.info.update(info)
        sglang_extract(tmp_path / "run", merged_small, random_target, server.url,
                       tmp_path / "dumps")
    writer.close()
    assert not server.batch_sizes


# --------------------------------------------------------------------------- launch

def test_capture_launch_turns_off_radix_cache_and_chunked_prefill(tmp_path, random_target,
                                                                 monkeypatch):
    import draftsmith.extract.sglang_backend as backend

    parsed = []
    monkeypatch.setattr(backend, "check_with_sglang_parser", parsed.append)
    cfg = ExtractConfig(backend="sglang", sglang={"port": 31000, "mem_fraction_static": 0.8})
    target_cfg = TargetConfig(model=random_target.path, tp_size=8, dtype="bfloat16")
    launch = build_capture_launch(cfg, target_cfg, random_target.path, "DeepseekV3ForCausalLM",
                                  [2, 30, 58], tmp_path / "d")
    argv = launch.argv
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--disable-radix-cache" in argv
    assert argv[argv.index("--chunked-prefill-size") + 1] == "-1"
    assert argv[argv.index("--tp-size") + 1] == "8"
    assert argv[argv.index("--port") + 1] == "31000"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert launch.env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == EXTERNAL_PACKAGE
    assert launch.env[ENV_LAYERS] == "2,30,58" and launch.env[ENV_ARCH] == "DeepseekV3ForCausalLM"
    assert launch.env[ENV_DIR] == str(tmp_path / "d")
    assert parsed == [launch]  # SGLang's own parser reads it whenever sglang is installed
    bad = ExtractConfig(backend="sglang", sglang={"extra_args": ["--chunked-prefill-size",
                                                                 "8192"]})
    with pytest.raises(ValueError, match="chunked-prefill-size"):
        build_capture_launch(bad, target_cfg, random_target.path, "X", [1], tmp_path)
    # No CUDA graphs, spelled as 0.5.23 wants (--disable-cuda-graph is its deprecated alias).
    assert "--disable-cuda-graph" not in argv
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert argv[argv.index("--cuda-graph-backend-decode") + 1] == "disabled"


@pytest.mark.parametrize("extra_args", [
    ["--enable-dp-attention"], ["--attn-dp-size", "8"], ["--attn-dp-size=8"],
    ["--attention-data-parallel-size", "2"], ["--dp-size", "8", "--enable-dp-attention"]])
def test_capture_refuses_attention_data_parallel_in_each_spelling(tmp_path, random_target,
                                                                  extra_args):
    """Each attention-DP rank takes its own requests and only rank 0 writes: the others'
    dumps would never come. 0.5.23 spells it --attn-dp-size N (--enable-dp-attention is its
    deprecated form)."""
    target_cfg = TargetConfig(model=random_target.path, tp_size=8)
    dp = ExtractConfig(backend="sglang", sglang={"extra_args": extra_args})
    with pytest.raises(ValueError, match="attention data parallel"):
        build_capture_launch(dp, target_cfg, random_target.path, "X", [1], tmp_path)
    width_one = ExtractConfig(backend="sglang", sglang={"extra_args": ["--attn-dp-size", "1"]})
    build_capture_launch(width_one, target_cfg, random_target.path, "X", [1], tmp_path)


def test_capture_command_is_printed_for_a_config(tmp_path, random_target_dir, capsys):
    from draftsmith.extract.sglang_backend import main

    config = tmp_path / "c.yaml"
    config.write_text(f"""
target: {{model: {random_target_dir}, tp_size: 2}}
data: {{sources: [{{name: a, path: x.jsonl}}]}}
extract: {{backend: sglang, sglang: {{dump_dir: /dev/shm/caps, port: 31555}}}}
""")
    main([str(config)])
    line = capsys.readouterr().out.strip()
    assert f"SGLANG_EXTERNAL_MODEL_PACKAGE={EXTERNAL_PACKAGE}" in line
    assert f"{ENV_LAYERS}=1,3,4" in line and f"{ENV_DIR}=/dev/shm/caps" in line
    assert "--disable-radix-cache --chunked-prefill-size -1" in line
    assert "--port 31555" in line and "--tp-size 2" in line



def launched_capture(tmp_path, port: int, **sglang) -> ExtractConfig:
    return ExtractConfig(backend="sglang", shard_tokens=150, sglang={
        "port": port, "dump_dir": str(tmp_path / "dumps"), "dump_timeout_s": 20,
        "startup_timeout_s": 120, "sglang_command": [sys.executable, str(Path(__file__).with_name(
            "fake_capture_server.py"))], **sglang})


def test_probe_names_the_import_error_sglang_logged(tmp_path, merged_small, random_target):
    cfg = launched_capture(tmp_path, free_port(), dump_timeout_s=3,
                           env={"FAKE_CAPTURE_MODE": "no_package"})
    plan = plan_stage(tmp_path / "run", "extract", {"launched": 2}, [merged_small, random_target])
    with pytest.raises(CaptureError, match="SGLang could not load draftsmith's capture package"
                       ) as err:
        run_extract(cfg, TargetConfig(model=random_target.path), merged_small, random_target,
                    plan)
    assert "No module named 'sgl_kernel'" in str(err.value)


def test_stage_starts_supervises_and_stops_its_capture_server(tmp_path, merged_small,
                                                             random_target, random_target_model):
    """extract.sglang.url unset: the stage launches the server itself (here a stand-in that
    reads the launcher's flags and environment like SGLang and the capture package would)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dumps = tmp_path / "dumps"
    cfg = ExtractConfig(backend="sglang", shard_tokens=150, sglang={
        "port": port, "dump_dir": str(dumps), "dump_timeout_s": 20, "startup_timeout_s": 120,
        "sglang_command": [sys.executable, str(Path(__file__).with_name(
            "fake_capture_server.py"))]})
    plan = plan_stage(tmp_path / "run", "extract", {"launched": 1}, [merged_small, random_target])
    descriptor = run_extract(cfg, TargetConfig(model=random_target.path), merged_small,
                             random_target, plan)
    reader = ShardReader(descriptor.path)
    row = pq.read_table(Path(merged_small.path) / "train.parquet").to_pylist()[5]
    aux, final = HiddenStateCapture(random_target_model, AUX_IDS)(
        torch.tensor([row["input_ids"]]), None)
    torch.testing.assert_close(reader.sample(row["id"]).aux, aux[0], rtol=1e-5, atol=1e-6)
    server_log = (plan.dir / ".capture-server.log").read_text()
    assert "--disable-radix-cache" in server_log and "LlamaForCausalLM" in server_log
    with socket.socket() as s:  # stopped with its process group at the end
        assert s.connect_ex(("127.0.0.1", port)) != 0
