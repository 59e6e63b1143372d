"""The tiny target: a small Llama and a BPE tokenizer built locally, for the CPU demo and tests.

Nothing is downloaded. The tokenizer is trained with `tokenizers` on the Python standard
library's own source files, which every machine with Python has. For the demo the model is
then trained for about a minute on "complete this function" chats made from the same files,
so its next-token distribution is peaked and real (a drafter can learn it); tests may ask for
random weights where quality does not matter.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import math
import shutil
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.progress import Progress

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Bump when the recipe below changes, so cached builds are not reused.
RECIPE_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML-style template. `{% generation %}` marks the assistant tokens, which lets transformers
# return the assistant-only loss mask; the end-of-turn token is inside it, so the drafter learns
# to predict where an answer ends.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] }}{{ '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def stdlib_sources() -> list[Path]:
    """Top-level standard-library modules, sorted so every build sees them in one order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_functions(max_lines: int = 24) -> Iterator[tuple[str, str, str]]:
    """(module, signature line, rest of the body) for short functions of the standard library."""
    return python_functions(stdlib_sources(), max_lines)


def python_functions(paths: list[Path], max_lines: int = 24) -> Iterator[tuple[str, str, str]]:
    """(module, signature line, rest of the body) for short undecorated functions in these
    Python files; files that do not parse are skipped."""
    for path in paths:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            body = lines[node.lineno - 1 : node.end_lineno]
            if not 3 <= len(body) <= max_lines or not body[0].rstrip().endswith(":"):
                continue
            indent = len(body[0]) - len(body[0].lstrip())
            body = [line[indent:] for line in body]
            yield path.stem, body[0], "\n".join(body[1:])


def function_chat(module: str, signature: str, body: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"Complete this function from {module}.py:\n{signature}"},
        {"role": "assistant", "content": body},
    ]


def is_heldout(signature: str, share: int = 10) -> bool:
    """About 1 in `share` functions are kept out of the target's training (demo prompts)."""
    return int(hashlib.sha256(signature.encode()).hexdigest(), 16) % share == 0


def train_tokenizer(out_dir: Path, vocab_size: int, files: list[Path] | None = None):
    """A byte-level BPE with the ChatML template, trained on `files` (default: the standard
    library's modules)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in files or stdlib_sources()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    params = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    params.update(overrides)
    return LlamaConfig(**params)


def _training_rows(tokenizer, seq_len: int) -> torch.Tensor:
    import torch

    stream: list[int] = []
    for module, signature, body in stdlib_functions():
        if is_heldout(signature):
            continue
        chat = function_chat(module, signature, body)
        stream += tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    n_rows = len(stream) // seq_len
    return torch.tensor(stream[: n_rows * seq_len]).view(n_rows, seq_len)  # [N, S]


def build_tiny_target(
    out_dir: str | Path,
    *,
    train_steps: int = 300,
    vocab_size: int = 2048,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """Build the tiny target into `out_dir` (atomically: a crash leaves nothing half-built).

    train_steps=0 gives random weights, for tests that do not need a peaked distribution.
    """
    import torch
    from transformers import LlamaForCausalLM

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    started = time.monotonic()
    tokenizer = train_tokenizer(tmp, vocab_size)
    config = tiny_llama_config(len(tokenizer), **config_overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = LlamaForCausalLM(config)
    final_loss = float("nan")
    if train_steps:
        rows = _training_rows(tokenizer, seq_len)
        log.info("tiny target: training %d steps on %d rows of %d tokens from the standard library",
                 train_steps, len(rows), seq_len)
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        def warmup_cosine(step: int) -> float:
            return min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / train_steps))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        progress = Progress("tiny target training", total=train_steps, unit="step")
        model.train()
        for _ in range(train_steps):
            batch = rows[torch.randint(len(rows), (batch_size,), generator=generator)]  # [B, S]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            final_loss = loss.item()
            progress.update(1, loss=f"{final_loss:.3f}")
        progress.close()
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "draftsmith_tiny_target.txt").write_text(
        f"recipe {RECIPE_VERSION}, steps {train_steps}, seed {seed}, final loss {final_loss:.4f}, "
        f"built in {time.monotonic() - started:.0f}s\n"
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log.info("tiny target ready at %s (final training loss %.3f, %.0fs)", out_dir, final_loss,
             time.monotonic() - started)
    return out_dir
