"""The Prefect UI screenshots of the documentation (docs/images/), taken the way the suite sees
the UI: a real `prefect server start`, `draftsmith prefect setup`, a process worker per pool and
one run of the tiny pipeline started as the UI starts it (tests/test_prefect_server.py), then
headless Chromium (tests/browser.py) on each page. The PNGs are cropped to the page's content,
scaled and reduced to a palette, so each stays a few tens of kB.

    python -m tests.ui_screenshots [--out docs/images]

Needs Debian's chromium and chromium-driver; takes a few minutes (the run trains the tiny
target's drafter). The builtin target is built into DRAFTSMITH_CACHE, or reused from
DRAFTSMITH_TEST_CACHE when that names the tests' cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageChops

from tests import browser
from tests.conftest import REPO

WIDTH = 1000  # pixels of the saved images
COLORS = 64


def shrink(source: Path, destination: Path) -> int:
    """Crop the empty space under the content, scale to WIDTH, save as a palette PNG; bytes."""
    image = Image.open(source).convert("RGB")
    background = Image.new("RGB", image.size, image.getpixel((image.width - 1,
                                                              image.height - 1)))
    box = ImageChops.difference(image, background).getbbox()
    if box:
        image = image.crop((0, 0, image.width, min(image.height, box[3] + 24)))
    height = round(image.height * WIDTH / image.width)
    image = image.resize((WIDTH, height), Image.Resampling.LANCZOS)
    image = image.quantize(colors=COLORS, method=Image.Quantize.MEDIANCUT)
    tmp = destination.with_suffix(".tmp.png")
    image.save(tmp, optimize=True)
    tmp.replace(destination)
    return destination.stat().st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.ui_screenshots",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    args = parser.parse_args(argv)
    problem = browser.missing()
    if problem:
        sys.exit(problem)
    if os.environ.get("DRAFTSMITH_TEST_CACHE"):
        os.environ.setdefault("DRAFTSMITH_CACHE", os.environ["DRAFTSMITH_TEST_CACHE"])
    from tests.test_prefect_server import (
        BIN,
        Server,
        latest,
        start_from_ui,
        start_workers,
        write_tiny_config,
    )

    root = Path(tempfile.mkdtemp(prefix="draftsmith-screenshots-"))
    (root / "orch").mkdir()
    server = Server(root)
    chrome = None
    try:
        server.start("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                "--port", str(server.port)])
        server.wait_healthy()
        start_workers(server, write_tiny_config(root / "orch"))
        deployment, run_id = start_from_ui(server)
        run = server.wait_run(run_id, timeout_s=3600)  # a busy machine builds the target slowly
        if run["state_type"] != "COMPLETED":
            sys.exit(f"the pipeline run ended {run['state_type']}: {run['state']}")
        runs = [run_id, *(c["id"] for c in server.flow_runs(
            parent_flow_run_id={"any_": [run_id]}))]
        mine = {"flow_run_id": {"any_": runs}}
        artifact = {key: latest(server, f"draftsmith-tiny-{key}", **mine)["id"]
                    for key in ("train-summary", "benchmark")}
        pages = {  # image name: (page, text the page shows once rendered)
            "deployments": (f"{server.ui}/deployments", "draftsmith-train"),
            "run-form": (f"{server.ui}/deployments/deployment/{deployment['id']}/run",
                         "full_config"),
            "flow-run": (f"{server.ui}/runs/flow-run/{run_id}", "benchmark"),
            "train-summary": (f"{server.ui}/artifacts/artifact/{artifact['train-summary']}",
                              "tau"),
            "benchmark": (f"{server.ui}/artifacts/artifact/{artifact['benchmark']}",
                          "acceptance"),
        }
        chrome = browser.Browser()
        args.out.mkdir(parents=True, exist_ok=True)
        for name, (url, text) in pages.items():
            if not chrome.show(url, text):
                sys.exit(f"{url}: the page never showed {text!r}")
            raw = chrome.screenshot(root / f"{name}.png")
            size = shrink(raw, args.out / f"{name}.png")
            print(f"{args.out / name}.png: {size // 1024} kB")
    finally:
        if chrome is not None:
            chrome.close()
        server.stop()


if __name__ == "__main__":
    main()
