"""A stand-in for `python -m sglang.launch_server` that speaks SGLang's HTTP shapes.

No GPU SGLang runs here, so the launcher, supervision and readiness tests start this instead.
It parses the flags draftsmith emits, serves /health, /server_info (with the SGLang version,
FAKE_SGLANG_VERSION, 0.5.23 by default, "none" for no version) and /generate (with
meta_info: completion_tokens, and spec_verify_ct / spec_accept_length only for a request that
had a verify step, as SGLang does; streamed as server-sent events when asked), and misbehaves
on request through FAKE_SGLANG_MODE: never_listen, wrong_algorithm, generate_fails, crash,
spawn_child. When --model-path is a real model directory, /generate runs draftsmith's
embedded speculative engine on it with the draft model, greedy, one request at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from json_http import JsonHandler  # tests/ is on sys.path: this file runs as a script

MODE = os.environ.get("FAKE_SGLANG_MODE", "")
VERSION = os.environ.get("FAKE_SGLANG_VERSION", "0.5.23")


def spec_meta(tokens: int, verify_rounds: int) -> dict:
    """SGLang's meta_info: the speculative fields only after at least one verify step."""
    meta = {"completion_tokens": tokens}
    if verify_rounds > 0:
        meta.update(spec_verify_ct=verify_rounds, spec_accept_length=tokens / verify_rounds)
    return meta


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    args, _ = p.parse_known_args()
    return args


def main() -> None:
    args = parse()
    print(f"fake sglang: loading {args.model_path}", flush=True)
    if MODE == "crash":
        print("fake sglang: CUDA out of memory", flush=True)
        sys.exit(3)
    if MODE == "spawn_child":  # a worker in the same process group, like TP schedulers
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"fake sglang: worker pid {child.pid}", flush=True)
    if MODE == "never_listen":
        time.sleep(600)
    engine = plain = None
    if os.path.isfile(os.path.join(args.model_path, "config.json")):
        from draftsmith.serve.embedded import (
            EmbeddedSpeculativeEngine,
            TargetRunner,
            plain_generate,
        )
        from draftsmith.target import load_target_model

        model = load_target_model(args.model_path)
        if args.speculative_draft_model_path:
            engine = EmbeddedSpeculativeEngine.load(
                model, args.speculative_draft_model_path, args.speculative_num_steps or 3,
                topk=args.speculative_eagle_topk or 1,
                num_draft_tokens=args.speculative_num_draft_tokens)
        else:  # served without speculation: plain greedy decoding
            runner = TargetRunner(model, [0])
            plain = lambda ids, n: plain_generate(runner, ids, n, eos)  # noqa: E731
        eos = model.generation_config.eos_token_id
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    engine_lock = threading.Lock()

    def generate(request: dict) -> list[tuple[list[int], dict]]:
        """(output_ids so far, meta_info) per streamed chunk; the last one is final."""
        n = request.get("sampling_params", {}).get("max_new_tokens", 8)
        if plain is not None:
            prompt = request.get("input_ids") or tokenizer(request["text"])["input_ids"]
            with engine_lock:
                tokens = plain(list(prompt), n).tokens
            return [(tokens[:i], {"completion_tokens": i}) for i in range(1, len(tokens) + 1)]
        if engine is None:
            ids = list(range(n))
            return [(ids, spec_meta(n, n // 2))]
        prompt = request.get("input_ids") or tokenizer(request["text"])["input_ids"]
        with engine_lock:
            result = engine.generate(list(prompt), n, eos)
        chunks, done = [], 1  # the first token comes from prefill
        chunks.append((result.tokens[:1], spec_meta(1, 0)))
        for rounds, produced in enumerate(result.round_tokens, start=1):
            done = min(len(result.tokens), done + produced)
            chunks.append((result.tokens[:done], spec_meta(done, rounds)))
        final_ids = result.tokens
        chunks.append((final_ids, spec_meta(len(final_ids), result.verify_rounds)))
        return chunks

    info = {
        "model_path": args.model_path,
        **({"version": VERSION} if VERSION != "none" else {}),
        "speculative_algorithm": "EAGLE" if MODE == "wrong_algorithm"
        else args.speculative_algorithm,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "speculative_num_steps": args.speculative_num_steps,
        "speculative_eagle_topk": args.speculative_eagle_topk,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
    }

    class Handler(JsonHandler):

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self.send_json(200, {})
            elif self.path == "/server_info":
                self.send_json(200, info)
            else:
                self.send_json(404, {"error": "not found"})

        def do_POST(self):  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            request = json.loads(self.rfile.read(length) or b"{}")
            if self.path != "/generate":
                self.send_json(404, {"error": "not found"})
            elif MODE == "generate_fails":
                self.send_json(500, {"error": "CUDA error: an illegal memory access"})
            elif not request.get("stream"):
                ids, meta = generate(request)[-1]
                self.send_json(200, {"text": " tok" * len(ids), "output_ids": ids,
                                     "meta_info": meta})
            else:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for ids, meta in generate(request):
                    chunk = {"text": " tok" * len(ids), "output_ids": ids, "meta_info": meta}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake sglang: ready on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
