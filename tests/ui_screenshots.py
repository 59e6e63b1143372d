"""The Prefect UI screenshots of the documentation (docs/images/), taken the way the suite sees
the UI: a real `prefect server start`, `draftsmith prefect setup`, a process worker per pool and
one run of the tiny pipeline started as the UI starts it (tests/test_prefect_server.py), then
headless Chromium (tests/browser.py) on each page. The PNGs are cropped to the page's content,
scaled and reduced to a palette, so each stays a few tens of kB.

    python -m tests.ui_screenshots [--out docs/images] [--random-target]

Needs Debian's chromium and chromium-driver; takes a few minutes. The trained tiny target is
built into DRAFTSMITH_CACHE (or reused from DRAFTSMITH_TEST_CACHE when that names the tests'
cache); on a busy machine its training can take an hour, and --random-target runs the same
pipeline on an untrained tiny target built in seconds (its charts then show an untrained
drafter).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from PIL import Image

from tests import browser
from tests.conftest import REPO

WIDTH = 1000  # pixels of the saved images
COLORS = 64


# The lowest edge of what the page shows right of the navigation (the UI draws a decoration
# under the navigation, so the image alone does not tell where the content ends).
CONTENT_BOTTOM = """
let bottom = 0;
for (const e of document.querySelectorAll('body *')) {
  const r = e.getBoundingClientRect();
  const leaf = e.children.length === 0 || ['IMG', 'CANVAS', 'svg'].includes(e.tagName);
  if (leaf && r.width > 0 && r.height > 0 && r.left >= arguments[0]) {
    bottom = Math.max(bottom, r.bottom);
  }
}
return bottom * window.devicePixelRatio;
"""
NAVIGATION_WIDTH = 180  # CSS pixels


def shrink(source: Path, destination: Path, bottom: float) -> int:
    """Cut the empty space under the content, scale to WIDTH, save as a palette PNG; bytes."""
    image = Image.open(source).convert("RGB")
    image = image.crop((0, 0, image.width, min(image.height, int(bottom) + 24)))
    height = round(image.height * WIDTH / image.width)
    image = image.resize((WIDTH, height), Image.Resampling.LANCZOS)
    image = image.quantize(colors=COLORS, method=Image.Quantize.MEDIANCUT)
    tmp = destination.with_suffix(".tmp.png")
    image.save(tmp, optimize=True)
    tmp.replace(destination)
    return destination.stat().st_size


def use_random_target(config: Path, directory: Path) -> None:
    """Point the config at an untrained tiny target (the demo's shape and tokenizer)."""
    import yaml

    from draftsmith.tiny_target import build_tiny_target

    raw = yaml.safe_load(config.read_text())
    raw["target"]["model"] = str(build_tiny_target(directory, train_steps=0))
    config.write_text(yaml.safe_dump(raw))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.ui_screenshots",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--random-target", action="store_true",
                        help="an untrained tiny target (seconds) instead of the trained one")
    args = parser.parse_args(argv)
    # Stopped with SIGTERM, still stop the server and workers below (they run in their own
    # process groups, so nothing else would).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
        config = write_tiny_config(root / "orch")
        if args.random_target:
            use_random_target(config, root / "target")
        start_workers(server, config)
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
            bottom = chrome.driver.execute_script(CONTENT_BOTTOM, NAVIGATION_WIDTH)
            raw = chrome.screenshot(root / f"{name}.png")
            size = shrink(raw, args.out / f"{name}.png", bottom)
            print(f"{args.out / name}.png: {size // 1024} kB")
    finally:
        if chrome is not None:
            chrome.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
