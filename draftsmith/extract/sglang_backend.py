"""extract.backend=sglang: hidden states from an SGLang capture server.

For targets only SGLang can serve (Kimi-K2.5 on 8 GPUs). The server is stock SGLang with
draftsmith's external model package (sglang_dump.py), started with the radix cache and chunked
prefill off (a cached prefix is not recomputed, so its hidden states would be missing; a
chunked prefill is seen in pieces). The client sends each sample's token ids with its own
request id and max_new_tokens=1, reads the dump named by that id, checks the tokens in it
against the sample, and assembles the same shards as the transformers backend. Finished shards
are skipped on a rerun; dumps are deleted once their shard is written.

Before bulk capture the server must prove itself: /server_info reports a supported SGLang
without attention data parallelism, and one real request (the probe) produces a dump with
the expected shapes, layers and layer count. Otherwise the stage stops, naming the likely
cause, instead of timing out sample after sample.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open

from draftsmith.config import ExtractConfig, TargetConfig, sglang_flag
from draftsmith.errors import ConfigValueError, TransientError
from draftsmith.extract.sglang_dump import (
    ENV_ARCH,
    ENV_DIR,
    ENV_LAYERS,
    content_key,
    dump_name,
)
from draftsmith.extract.store import (
    AsyncShardWriter,
    ShardSpec,
    finished_shard,
    free_disk_bytes,
    gather_shard,
)
from draftsmith.figures import TargetFigures
from draftsmith.progress import Progress
from draftsmith.serve.process import ManagedProcess
from draftsmith.serve.readiness import wait_for_port
from draftsmith.serve.sglang_launch import (
    SGLangLaunch,
    UnsupportedSGLangError,
    check_sglang_version,
    check_with_sglang_parser,
)

log = logging.getLogger(__name__)

EXTERNAL_PACKAGE = "draftsmith.extract.sglang_models"
REPO_ROOT = Path(__file__).resolve().parents[2]


class CaptureError(TransientError, RuntimeError):
    pass


class DumpMissing(CaptureError):
    """The server answered a request and no dump appeared."""


PROBE_TOKENS = 16
# What SGLang's registry logs when a module of the external package fails to import
# (sglang/srt/models/registry.py, import_model_classes), and what the package logs itself.
SGLANG_IMPORT_ERROR = "Ignore import error when loading draftsmith.extract.sglang_models"
PACKAGE_FAILED = "draftsmith capture: the capture package could not be loaded"
PACKAGE_LOADED = "draftsmith capture:"


def check_capturable(aux_ids: list[int], num_layers: int) -> None:
    if max(aux_ids) >= num_layers - 1:
        raise ConfigValueError(
            f"extract.aux_layer_ids={aux_ids}: with extract.backend=sglang the largest id is "
            f"{num_layers - 2} (SGLang records the input of layer i+1, and layer {num_layers} "
            "does not exist); the final layer's output is stored as `final` anyway")


def check_no_attention_dp(extra_args: list[str]) -> None:
    """Attention data parallelism hands each attention-DP rank its own requests, and only
    tensor-parallel rank 0 writes dumps: the other ranks' requests would never be dumped."""
    width = sglang_flag(extra_args, "--attn-dp-size", "--attention-data-parallel-size")
    if "--enable-dp-attention" in extra_args or (width is not None and width != "1"):
        spelled = ("--enable-dp-attention" if "--enable-dp-attention" in extra_args
                   else f"--attn-dp-size {width}")
        raise ConfigValueError(
            f"extract.sglang.extra_args: {spelled} runs attention data parallel: each DP rank "
            "takes its own requests and only rank 0 writes dumps, so the others would time "
            "out; capture with plain tensor parallelism (--tp-size only)")


def build_capture_launch(cfg: ExtractConfig, target_cfg: TargetConfig, model_path: str,
                         architecture: str, aux_ids: list[int], dump_dir: str | Path
                         ) -> SGLangLaunch:
    s = cfg.sglang
    env = {**s.env, "SGLANG_EXTERNAL_MODEL_PACKAGE": EXTERNAL_PACKAGE, ENV_ARCH: architecture,
           ENV_LAYERS: ",".join(map(str, aux_ids)), ENV_DIR: str(dump_dir)}
    # The package must import in SGLang's processes even when draftsmith runs from a checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                        if p)
    argv = [
        *(s.sglang_command or [sys.executable, "-m", "sglang.launch_server"]),
        "--model-path", model_path,
        "--tp-size", str(target_cfg.tp_size),
        "--host", s.host,
        "--port", str(s.port),
        "--disable-radix-cache",  # a cached prefix would be skipped, its states missing
        "--chunked-prefill-size", "-1",  # one prefill per request, never pieces
        # No CUDA graphs: a captured prefill graph would replay without the dump hook, and
        # decode graphs only cost startup (0.5.23 deprecates --disable-cuda-graph for these).
        "--cuda-graph-backend-decode", "disabled",
        "--cuda-graph-backend-prefill", "disabled",
    ]
    if target_cfg.context_length:
        argv += ["--context-length", str(target_cfg.context_length)]
    if s.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(s.mem_fraction_static)]
    if target_cfg.dtype != "float32":
        argv += ["--dtype", target_cfg.dtype]
    for flag in ("--enable-radix-cache", "--chunked-prefill-size"):
        if flag in s.extra_args:
            raise ConfigValueError(f"extract.sglang.extra_args: {flag} is set by draftsmith for "
                             "capture (radix cache off, chunked prefill off)")
    check_no_attention_dp(s.extra_args)
    argv += s.extra_args
    launch = SGLangLaunch(argv=argv, env=env, host=s.host, port=s.port, drafter_dir=None)
    check_with_sglang_parser(launch)
    return launch


def request_id(nonce: str, sample_id: str) -> str:
    return f"ds-{nonce}-{hashlib.sha256(sample_id.encode()).hexdigest()[:20]}"


class CaptureClient:
    """Sends samples to a capture server and collects their dumps, matched by request id and
    checked by token content."""

    def __init__(self, url: str, dump_dir: str | Path, concurrency: int,
                 dump_timeout_s: float, expected_width: tuple[int, int]):
        self.url, self.dump_dir = url.rstrip("/"), Path(dump_dir)
        self.concurrency, self.dump_timeout_s = concurrency, dump_timeout_s
        self.aux_width, self.hidden = expected_width
        self.nonce = uuid.uuid4().hex[:8]  # a new attempt never takes an old attempt's dumps
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0))

    def close(self) -> None:
        self.client.close()

    def _find_dump(self, rid: str, input_ids: list[int]) -> Path:
        by_rid = self.dump_dir / dump_name(rid, input_ids)
        by_content = self.dump_dir / f"{content_key(input_ids)}.safetensors"
        deadline = time.monotonic() + self.dump_timeout_s
        while True:
            for path in (by_rid, by_content):
                if path.is_file():
                    return path
            if time.monotonic() > deadline:
                raise DumpMissing(
                    f"request {rid}: answered, but no dump {by_rid.name} (or {by_content.name}) "
                    f"in {self.dump_dir} after {self.dump_timeout_s:.0f}s. Is the server "
                    "running draftsmith's capture model (its log says 'draftsmith capture'), "
                    "and is the dump directory shared with this process?")
            time.sleep(0.005)

    def capture(self, sample_id: str, input_ids: list[int]) -> dict[str, torch.Tensor]:
        return self.capture_with_metadata(sample_id, input_ids)[0]

    def capture_with_metadata(self, sample_id: str, input_ids: list[int]
                              ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        rid = request_id(self.nonce, sample_id)
        response = self.client.post("/generate", json={
            "input_ids": input_ids, "rid": rid,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        if response.status_code != 200:
            raise CaptureError(f"sample {sample_id}: /generate answered {response.status_code}: "
                               f"{response.text[:300]}")
        path = self._find_dump(rid, input_ids)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in ("input_ids", "aux", "final")}
        n = len(input_ids)
        if tensors["input_ids"].tolist() != input_ids:
            raise CaptureError(f"sample {sample_id}: dump {path.name} holds other tokens than "
                               "the request (a dump matched to the wrong request)")
        if int(meta.get("prefix_len", "0")) != 0:
            raise CaptureError(f"sample {sample_id}: the server reused a cached prefix of "
                               f"{meta['prefix_len']} tokens, so their states are missing; start "
                               "it with --disable-radix-cache")
        if (tuple(tensors["aux"].shape) != (n, self.aux_width)
                or tuple(tensors["final"].shape) != (n, self.hidden)):
            raise CaptureError(f"sample {sample_id}: dump shapes aux {tuple(tensors['aux'].shape)}"
                               f", final {tuple(tensors['final'].shape)}; expected ({n}, "
                               f"{self.aux_width}) and ({n}, {self.hidden})")
        path.unlink(missing_ok=True)
        return tensors, meta

    def capture_shard(self, spec: ShardSpec, rows: dict[str, dict], store_dtype,
                      pool: ThreadPoolExecutor) -> dict[str, Any]:
        return gather_shard(self.capture, spec, rows, store_dtype, pool)


def default_dump_dir(out: Path) -> Path:
    """Dumps live seconds: RAM-backed /dev/shm keeps them off the disk when it exists."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"draftsmith-dumps-{hashlib.sha256(str(out).encode()).hexdigest()[:12]}"
    return out / "dumps"


def capture_shards(client: CaptureClient, out: Path, specs: list[ShardSpec],
                   rows: dict[str, list[dict]], cfg: ExtractConfig) -> dict[str, Any]:
    by_id = {r["id"]: r for split_rows in rows.values() for r in split_rows}
    pending = [s for s in specs if finished_shard(out, s) is None]
    total = sum(s.num_tokens for s in pending)
    progress = Progress("extract (sglang)", total=total, unit="token")
    writer = AsyncShardWriter(out, max_pending=cfg.writer_queue, threads=cfg.writer_threads)
    samples = 0
    started = time.monotonic()
    from draftsmith.target import DTYPES

    try:
        with ThreadPoolExecutor(max_workers=client.concurrency) as pool:
            for spec in pending:
                tensors = client.capture_shard(spec, by_id, DTYPES[cfg.dtype], pool)
                writer.submit(spec, lambda t=tensors: t)
                samples += len(spec.ids)
                progress.update(spec.num_tokens, samples=samples,
                                written=f"{writer.bytes_written / 2**30:.2f} GiB",
                                free_disk=f"{free_disk_bytes(out) / 2**30:.1f} GiB")
    finally:
        writer.close()
    progress.close()
    seconds = time.monotonic() - started
    return {"shards": len(pending), "tokens": total, "seconds": seconds,
            "skipped": len(specs) - len(pending)}


def check_capture_server(url: str) -> dict[str, Any]:
    """/server_info of a capture server: a supported SGLang version, and no attention data
    parallelism (only tensor-parallel rank 0 writes; other DP ranks' requests never dump)."""
    info = None
    for path in ("/server_info", "/get_server_info"):  # newer and older SGLang
        response = httpx.get(f"{url}{path}", timeout=30.0)
        if response.status_code == 200:
            info = response.json()
            break
    if info is None:
        raise CaptureError(f"{url}: neither /server_info nor /get_server_info answers 200; is "
                           "it an SGLang server?")
    try:
        check_sglang_version(info.get("version"), f"the capture server at {url}")
    except UnsupportedSGLangError as err:
        raise CaptureError(str(err)) from None
    if int(info.get("attn_dp_size") or 1) > 1 or info.get("enable_dp_attention"):
        raise CaptureError(
            f"the capture server at {url} runs attention data parallel (attn_dp_size "
            f"{info.get('attn_dp_size')}): each DP rank takes its own requests and only rank 0 "
            "writes dumps. Restart it with plain tensor parallelism (no --attn-dp-size, no "
            "--enable-dp-attention)")
    return info


def likely_cause(server_log: Path | None, dump_dir: Path) -> str:
    """Why a probe's dump never came, from what the server logged (when this stage started
    it) or, for a server started elsewhere, the candidates."""
    text = server_log.read_text(errors="replace") if server_log and server_log.is_file() else None
    if text is not None:
        for marker in (SGLANG_IMPORT_ERROR, PACKAGE_FAILED):
            line = next((x for x in text.splitlines() if marker in x), None)
            if line is not None:
                return (f"SGLang could not load draftsmith's capture package and serves its "
                        f"stock class: {line.strip()} (server log: {server_log})")
        if PACKAGE_LOADED not in text:
            return ("the server never loaded draftsmith's capture package (no 'draftsmith "
                    "capture' line in its log): SGLANG_EXTERNAL_MODEL_PACKAGE did not reach it, "
                    "or this SGLang ignores it (server log: " + str(server_log) + ")")
        return (f"the capture package is loaded but no dump reached {dump_dir}: the directory "
                "is not the one the server writes to (extract.sglang.dump_dir), or the request "
                "ran on a rank that does not write (attention data parallelism)")
    return (f"either the server does not run draftsmith's capture package (SGLang logs "
            f"'{SGLANG_IMPORT_ERROR}' when it fails to import; start the server with the "
            "command `python -m draftsmith.extract.sglang_backend CONFIG` prints), or "
            f"{dump_dir} is not the directory it writes to, or it runs attention data parallel")


def probe_capture(client: CaptureClient, input_ids: list[int], aux_ids: list[int],
                  num_layers: int, server_log: Path | None) -> None:
    """One real request before bulk capture: its dump must hold the request's tokens, the
    expected shapes and the configured layers of a target of `num_layers` layers."""
    ids = list(input_ids[:PROBE_TOKENS])
    try:
        _, meta = client.capture_with_metadata("capture-probe", ids)
    except DumpMissing as err:
        raise CaptureError(f"extract: the capture probe failed before bulk capture: {err}\n"
                           f"Likely cause: {likely_cause(server_log, client.dump_dir)}") from None
    except CaptureError as err:
        raise CaptureError(f"extract: the capture probe failed before bulk capture: {err}"
                           ) from None
    want = ",".join(str(i + 1) for i in aux_ids)
    if meta.get("layers_to_capture", want) != want:
        raise CaptureError(
            f"extract: the capture server records the inputs of layers "
            f"{meta['layers_to_capture']}, not {want} (outputs of {aux_ids}, "
            "extract.aux_layer_ids): it was started for another config; restart it with the "
            "command `python -m draftsmith.extract.sglang_backend CONFIG` prints")
    if meta.get("num_layers", str(num_layers)) != str(num_layers):
        raise CaptureError(
            f"extract: the capture server's model has {meta['num_layers']} decoder layers, the "
            f"target has {num_layers}: it serves another model than target.model")
    log.info("extract: capture probe passed (%d tokens; %s captures the inputs of layers %s)",
             len(ids), meta.get("model", "the server"), want)


def wait_for_capture_server(url: str, host: str, port: int, process: ManagedProcess | None,
                            timeout_s: float) -> None:
    wait_for_port(host, port, process, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=30.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise CaptureError(f"{url}/health did not answer 200 within {timeout_s:.0f}s")
        time.sleep(2.0)


def probe_sample(pending: list[ShardSpec], rows: dict[str, list[dict]]) -> list[int]:
    """The tokens of the first sample still to capture."""
    first = pending[0].ids[0]
    return next(r for split_rows in rows.values() for r in split_rows
                if r["id"] == first)["input_ids"]


def run_sglang_capture(cfg: ExtractConfig, target_cfg: TargetConfig, target, out: Path,
                       specs: list[ShardSpec], rows: dict[str, list[dict]],
                       aux_ids: list[int]) -> dict[str, Any]:
    check_capturable(aux_ids, TargetFigures.of(target).num_layers)
    s = cfg.sglang
    dump_dir = Path(s.dump_dir) if s.dump_dir else default_dump_dir(out)
    dump_dir.mkdir(parents=True, exist_ok=True)
    facts = TargetFigures.of(target)
    hidden, architectures = facts.hidden_size, facts.architectures
    if not architectures:
        raise ConfigValueError(f"{target.path}/config.json: no 'architectures'; SGLang needs one "
                               "to pick the model class the capture package overrides")
    pending = [spec for spec in specs if finished_shard(out, spec) is None]
    if not pending:  # a rerun after everything was stored: no server needed
        return {"shards": 0, "tokens": 0, "seconds": 0.0, "skipped": len(specs)}
    process = None
    url = s.url
    if url is None:
        launch = build_capture_launch(cfg, target_cfg, target.path, architectures[0], aux_ids,
                                      dump_dir)
        # A dot name keeps the log out of the stage's content fingerprint.
        server_log = out / ".capture-server.log"
        log.info("extract: starting SGLang capture server (log: %s): %s", server_log,
                 launch.shell())
        process = ManagedProcess(launch.argv, server_log, env=launch.env,
                                 name="sglang-capture").start()
        url = launch.url
    try:
        if process is not None:
            wait_for_capture_server(url, s.host, s.port, process, s.startup_timeout_s)
        check_capture_server(url)
        client = CaptureClient(url, dump_dir, s.concurrency, s.dump_timeout_s,
                               (len(aux_ids) * hidden, hidden))
        try:
            probe_capture(client, probe_sample(pending, rows), aux_ids, facts.num_layers,
                          server_log if process is not None else None)
            return capture_shards(client, out, specs, rows, cfg)
        finally:
            client.close()
    finally:
        if process is not None:
            process.stop()


def main(argv: list[str] | None = None) -> None:
    """Print the capture server's command for a config, to start it yourself and point
    extract.sglang.url at it:  python -m draftsmith.extract.sglang_backend CONFIG [--set k=v]"""
    import argparse

    from draftsmith.config import load_config
    from draftsmith.export.layer_ids import aux_layer_ids_for
    from draftsmith.target import resolve_target

    parser = argparse.ArgumentParser(prog="python -m draftsmith.extract.sglang_backend")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    target = resolve_target(config.target)
    aux_ids = aux_layer_ids_for(config.extract, target)
    check_capturable(aux_ids, TargetFigures.of(target).num_layers)
    dump_dir = config.extract.sglang.dump_dir
    if dump_dir is None:
        raise SystemExit("set extract.sglang.dump_dir: a server you start yourself and this "
                         "pipeline must agree on where the dumps go")
    launch = build_capture_launch(config.extract, config.target, target.path,
                                  TargetFigures.of(target).architectures[0], aux_ids, dump_dir)
    print(launch.shell())


if __name__ == "__main__":
    main()
