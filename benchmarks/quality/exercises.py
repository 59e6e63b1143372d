"""Exercises the target writes itself, as training prompts like HumanEval's.

The drafters accept fewer tokens on HumanEval than on held-out training answers, within code and
within prose (acceptance_by_segment.py): the training prompts are library functions, HumanEval's
are small algorithmic exercises. Exercises that SmolLM2 writes itself look like HumanEval to the
drafter (exercise_probe.py: 2.85 against HumanEval's 2.88 and the training answers' 3.07-3.12).
This module makes such exercises a prompt set:

1. the target writes `per_topic` exercises for each of TOPICS, sampled (`written_exercises`):
   a function signature and a docstring, in a code block;
2. `select_exercises` keeps each one's signature and docstring (`exercise_head`) and drops the
   unusable, the duplicates (the same head, or more than `max_per_name` heads of one function
   name) and those that resemble a HumanEval prompt (the merge's overlap measure, at a stricter
   threshold than the merge's, so that the merge never fails on them);
3. optionally (`with_examples`), the target adds doctest examples to each kept docstring: 46% of
   HumanEval's prompts have them, 2% of the exercises. Asked for them, SmolLM2 does not write
   them (exercise_instructions.py); its answer started for it ("    >>> name(") it continues
   one in 25 of 38 exercises;
4. each kept head is a prompt in the python-functions form (`completion_prompt`), which the
   sweep's generate answers greedily, as every other training prompt.

sweep.py runs it as its `exercises` job (`sweep.py run --exercises PER_TOPIC`).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import textwrap
from collections import Counter
from typing import Any

TOPICS = (
    # the exercise probe's 48
    "lists of integers", "strings and vowels", "prime numbers", "word counts in a sentence",
    "sorting a list of tuples", "palindromes", "the digits of a number", "matrices",
    "fibonacci numbers", "anagrams", "running sums", "the greatest common divisor",
    "binary strings", "counting characters", "removing duplicates", "nested lists",
    "even and odd numbers", "the longest word", "rotating a list", "dictionaries",
    "sets of numbers", "parentheses", "leap years", "temperatures", "triangles",
    "factorials", "the median of a list", "capital letters", "merging two lists",
    "ranges of numbers", "reversing words", "squares and cubes", "the second largest number",
    "counting vowels", "caesar ciphers", "number bases", "intervals", "grades of students",
    "prices and discounts", "shopping lists", "file extensions", "dates as strings",
    "coins and change", "stacks", "queues", "binary search", "bubble sort", "string padding",
    # more of the same kind
    "the sum of digits", "perfect numbers", "armstrong numbers", "roman numerals",
    "run-length encoding", "the longest common prefix", "substrings", "vowels at the end",
    "the mean of a list", "the mode of a list", "the variance of numbers", "percentages",
    "the maximum of each row", "transposing a matrix", "the diagonal of a matrix",
    "pascal's triangle", "multiplication tables", "sequences of numbers", "arithmetic progressions",
    "geometric progressions", "the least common multiple", "divisors of a number",
    "prime factors", "coprime numbers", "powers of two", "bit counting", "hexadecimal strings",
    "binary to decimal", "decimal to binary", "rounding numbers", "absolute differences",
    "closest pairs of numbers", "pairs that sum to a target", "triplets that sum to zero",
    "the maximum subarray", "increasing sequences", "sorted lists", "insertion sort",
    "selection sort", "merge sort", "counting sort", "the kth smallest element",
    "frequencies of elements", "the most common word", "unique characters",
    "the first repeated character", "isograms", "pangrams", "camel case", "snake case",
    "title case", "whitespace in strings", "splitting a string", "joining words",
    "replacing characters", "shifting letters", "encrypting a message", "decoding a string",
    "counting words that start with a letter", "sentences and punctuation", "email addresses",
    "phone numbers", "urls", "passwords", "usernames", "time in hours and minutes",
    "durations in seconds", "days of the week", "months of the year", "ages of people",
    "bank accounts", "inventory of a store", "scores of a game", "votes in an election",
    "distances between points", "areas of shapes", "perimeters", "circles", "rectangles",
    "polygons", "coordinates on a grid", "paths in a grid", "mazes", "chess boards",
    "tic-tac-toe", "dice rolls", "playing cards", "lottery numbers", "temperatures in a week",
    "rainfall data", "stock prices", "salaries of employees", "students and their marks",
    "recipes and ingredients", "a to-do list", "a phone book", "books in a library",
    "flights and airports", "trains and stations", "parking lots", "elevators",
    "traffic lights", "bits and bytes", "checksums", "isbn numbers", "credit card numbers",
    "valid brackets", "balanced strings", "nested dictionaries", "flattening a list",
    "chunks of a list", "sliding windows", "zipping lists", "interleaving two strings",
    "common elements of two lists", "the difference of two lists", "list comprehensions",
    "filtering a list", "mapping values", "recursion", "memoization", "the tower of hanoi",
    "permutations", "combinations", "subsets", "the power set", "collatz sequences",
    "happy numbers", "digital roots", "numbers in words", "ordinal numbers",
)
EXERCISE = ("Write a short Python programming exercise about {topic}. Give only a function "
            "signature and a docstring that states the task with two examples, in a code block.")
CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)(?:```|$)", re.S)
# Stricter than the merge's merge.max_benchmark_overlap (0.5): the merge measures against all
# the training prompts together, whose shared n-grams differ a little from these alone.
MAX_HUMANEVAL_SIMILARITY = 0.3
# The question whose answer with_examples starts for the target.
EXAMPLES_ASK = ("Write a short Python programming exercise: a function signature and a docstring "
                "with two doctest examples, in a code block.")
# A doctest call with a result line below it (not another call, not the docstring's end).
DOCTEST = re.compile(r"^\s*>>> .+\n\s*(?!>>>|\"\"\"|\'\'\')\S", re.M)


def exercise_head(answer: str) -> str | None:
    """The signature and docstring of the first documented function in the answer's first
    code block (a body the target wrote anyway is dropped); None when there is none."""
    block = CODE_BLOCK.search(answer)
    source = block.group(1) if block else answer
    lines = source.splitlines()
    for cut in range(len(lines), 0, -1):  # a sampled block may end mid-statement
        try:
            tree = ast.parse("\n".join(lines[:cut]))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                return textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno]))
        return None
    return None


def exercise_requests(per_topic: int, topics: int | None = None, seed: int = 0
                      ) -> list[tuple[str, str]]:
    """(topic, instruction) for every exercise to write (the first `topics` of TOPICS), in
    one seeded order: a batch mixes topics, so that no batch is one topic's samples."""
    requests = [(topic, EXERCISE.format(topic=topic)) for topic in TOPICS[:topics]
                for _ in range(per_topic)]
    random.Random(seed).shuffle(requests)
    return requests


def written_exercises(generator, requests: list[tuple[str, str]], batch_size: int,
                      seed: int = 0, progress=None) -> list[tuple[str, str]]:
    """(topic, the target's text) for each request: a TransformersGenerator that samples,
    seeded per batch (the same seed for every batch would repeat a batch's samples)."""
    written = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        generator.generator_seed = seed + start // batch_size
        completions = generator.complete([[{"role": "user", "content": text}]
                                          for _, text in batch])
        written += [(topic, c.text) for (topic, _), c in zip(batch, completions, strict=True)]
        if progress is not None:
            progress(len(written), len(requests))
    return written


def example_prefix(head: str) -> str | None:
    """The start of an answer that repeats the head with its docstring left open and begins a
    doctest of the function; None when the docstring does not end the head."""
    body = head.rstrip()
    if not body.endswith(('"""', "'''")):
        return None
    return f"```python\n{body[:-3].rstrip()}\n\n    >>> {function_name(head)}("


def with_examples(generator, heads: list[str], batch_size: int) -> list[str]:
    """Each head with the doctest examples the target continues from `example_prefix` (a
    TransformersGenerator that decodes greedily); the head unchanged where the continuation
    gives no call with a result line below it."""
    tokenizer = generator.tokenizer
    question = generator.prompt_tokens([[{"role": "user", "content": EXAMPLES_ASK}]])[0]
    started = [(i, prefix) for i, h in enumerate(heads) if (prefix := example_prefix(h))]
    out = list(heads)
    for start in range(0, len(started), batch_size):
        batch = started[start:start + batch_size]
        prompts = [question + tokenizer(prefix, add_special_tokens=False)["input_ids"]
                   for _, prefix in batch]
        for (i, prefix), completion in zip(batch, generator.complete_tokens(prompts),
                                           strict=True):
            head = exercise_head(prefix + completion.text)
            same = head is not None and function_name(head) == function_name(heads[i])
            if same and DOCTEST.search(head):
                out[i] = head
    return out


def function_name(head: str) -> str:
    """The name of the function a head defines."""
    return head.split("(", 1)[0].removeprefix("def ").strip()


def select_exercises(written: list[tuple[str, str]], max_per_name: int = 3,
                     max_similarity: float = MAX_HUMANEVAL_SIMILARITY,
                     benchmark: list | None = None, add_examples=None
                     ) -> tuple[list[dict[str, Any]], dict]:
    """The usable exercises as prompt records ({"id", "topic", "head", "messages"}) and the
    count of each reason to drop one. benchmark: the prompts to keep away from (default:
    HumanEval's); an exercise whose function has a HumanEval entry point's name is dropped
    too. add_examples: heads -> heads (`with_examples`), applied to the kept heads before they
    are compared with the benchmark."""
    from draftsmith.data.formats import Message, Record
    from draftsmith.data.overlap import benchmark_prompt_set, similar_records
    from draftsmith.data.packaged import completion_prompt, humaneval_problems

    reserved = set()
    if benchmark is None:  # as the merge sees it (builtin:humaneval)
        benchmark = benchmark_prompt_set("humaneval", None)[1]
        reserved = {p["entry_point"] for p in humaneval_problems()}
    dropped: Counter[str] = Counter()
    seen: set[str] = set()
    per_name: Counter[str] = Counter()
    kept = []
    for topic, text in written:
        head = exercise_head(text)
        if head is None:
            dropped["no_documented_function"] += 1
            continue
        folded = " ".join(head.split())
        if folded in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(folded)
        name = function_name(head)
        if name in reserved:
            dropped["humaneval_name"] += 1
            continue
        if per_name[name] >= max_per_name:
            dropped["same_name"] += 1
            continue
        per_name[name] += 1
        kept.append((topic, head))
    topics, heads = [topic for topic, _ in kept], [head for _, head in kept]
    if add_examples is not None:
        heads = add_examples(heads)
    kept = []
    for topic, head in zip(topics, heads, strict=True):
        prompt = completion_prompt(head)
        kept.append({"id": "exercise-" + hashlib.sha256(prompt.encode()).hexdigest()[:16],
                     "topic": topic, "head": head,
                     "messages": [{"role": "user", "content": prompt}]})
    records = [Record(id=k["id"], source="exercises", messages=[Message(**m) for m in
                                                                k["messages"]]) for k in kept]
    similar = similar_records(records, benchmark, max_similarity)
    dropped["humaneval_like"] = len(similar)
    kept = [k for k in kept if k["id"] not in similar]
    counts = {"written": len(written), "kept": len(kept), **dict(dropped),
              "topics": len({k["topic"] for k in kept}),
              "max_per_name": max_per_name, "max_humaneval_similarity": max_similarity}
    if add_examples is not None:
        counts["with_doctest"] = sum(bool(DOCTEST.search(k["head"])) for k in kept)
    return kept, counts
