"""Regenerate the bundled demo data (examples/data/*.jsonl) from the Python standard library.

Prompts only: the target answers them in the generate stage. Functions come from the share the
tiny target never trains on, in two source formats (ShareGPT and OpenAI messages).

    python examples/make_demo_data.py
"""

import json
from pathlib import Path

from draftsmith.tiny_target import function_chat, is_heldout, stdlib_functions

OUT = Path(__file__).parent / "data"
PER_FORMAT = 150

heldout = [f for f in stdlib_functions() if is_heldout(f[1])]
OUT.mkdir(exist_ok=True)
with open(OUT / "sharegpt.jsonl", "w") as f:
    for i, fn in enumerate(heldout[:PER_FORMAT]):
        prompt = function_chat(*fn)[0]["content"]
        f.write(json.dumps({"id": f"sg-{i:04d}", "conversations": [
            {"from": "system", "value": "You write Python."},
            {"from": "human", "value": prompt}]}) + "\n")
with open(OUT / "openai.jsonl", "w") as f:
    for i, fn in enumerate(heldout[PER_FORMAT : 2 * PER_FORMAT]):
        prompt = function_chat(*fn)[0]["content"]
        f.write(json.dumps({"id": f"oa-{i:04d}",
                            "messages": [{"role": "user", "content": prompt}]}) + "\n")
print(f"wrote {min(PER_FORMAT, len(heldout))} + "
      f"{min(PER_FORMAT, max(0, len(heldout) - PER_FORMAT))} prompts to {OUT}")
