"""benchmarks/speculative_profile.py --graph-launches: a trace's CUDA graph launches grouped by
their kernels, each group's median span and busy time, its costliest kernels."""

from __future__ import annotations

import gzip
import json

from tests.scripts import benchmark_script


def launch(correlation: int, start: float, durations: list[float], names: list[str]) -> list:
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": start,
               "dur": 5, "args": {"correlation": correlation}}]
    at = start + 10
    for duration, name in zip(durations, names, strict=True):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": at, "dur": duration,
                       "args": {"correlation": correlation}})
        at += duration + 1  # a gap of 1 us between kernels
    return events


def test_graph_launches_are_grouped_by_their_kernels(tmp_path):
    events = (launch(1, 0, [10, 30, 5], ["gemv", "attention", "norm"])
              + launch(2, 100, [12, 34, 5], ["gemv", "attention", "norm"])
              + launch(3, 200, [4, 4], ["draft", "argmax"])
              # a kernel launched outside any graph, and another process's event
              + [{"ph": "X", "cat": "kernel", "name": "eager", "ts": 300, "dur": 9,
                  "args": {"correlation": 99}}, {"ph": "i", "name": "marker"}])
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    profile = benchmark_script("speculative_profile.py")
    out = tmp_path / "graphs.jsonl"
    profile.main(["--graph-launches", str(trace), "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["kernels"], r["launches"]) for r in rows] == [(3, 2), (2, 1)]
    verify = rows[0]
    assert verify["busy_us"] == 48  # median of 45 and 51
    assert verify["span_us"] == 50  # median of 47 and 53: busy plus two 1-us gaps
    assert list(verify["top_kernels_us"]) == ["attention", "gemv", "norm"]
    assert verify["top_kernels_us"]["attention"] == 32.0  # mean per launch
