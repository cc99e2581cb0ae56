"""Prompt suites for the research CLIs: the bundled suites, JSONL prompt files, tokenization.

A prompt is a dict {"id", "category", "text"} (text prompts) or {"id", "category", "tokens"}
(pre-tokenized). Bundled suites (JSON files next to this module):

    tiny       Python code / docstring beginnings, one theme per MTP-bench category: the domain of
               the bundled tiny byte-level model (trained on Python standard-library source).
    mtp-bench  nine prompts modelled on the llama.cpp community MTP bench (code_python, code_cpp,
               explain_concept, summarize, qa_factual, translation, creative_short, stepwise_math,
               long_code_review), for real chat/instruct checkpoints.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from typing import Callable, Iterable, Sequence

SUITE_FILES = {"tiny": "suite_tiny.json", "mtp-bench": "suite_mtp_bench.json"}
CATEGORIES = ("code_python", "code_cpp", "explain_concept", "summarize", "qa_factual", "translation",
              "creative_short", "stepwise_math", "long_code_review")


class PromptError(ValueError):
    """A prompt suite or prompt file that cannot be used (raised before any model work)."""


def load_suite(name: str) -> dict:
    """The bundled suite `name` as {"name", "description", "max_new_tokens", "prompts": [...]}."""
    if name not in SUITE_FILES:
        raise PromptError(f"unknown prompt suite {name!r}; choose from {sorted(SUITE_FILES)}")
    with open(os.path.join(os.path.dirname(__file__), SUITE_FILES[name]), encoding="utf-8") as f:
        return json.load(f)


def read_prompts_file(path: str) -> list[dict]:
    """JSONL, one prompt a line: {"id", "category", "tokens": [...]} or {"id", "category", "text"}."""
    if not os.path.isfile(path):
        raise PromptError(f"prompts file {path!r} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            prompts.append(_check_record(rec, f"{path}:{lineno}", len(prompts)))
    if not prompts:
        raise PromptError(f"prompts file {path!r} holds no prompts")
    return prompts


def _check_record(rec, where: str, index: int) -> dict:
    if not isinstance(rec, dict):
        raise PromptError(f"{where}: each line must be a JSON object")
    has_tokens, has_text = "tokens" in rec, "text" in rec
    if has_tokens == has_text:
        raise PromptError(f"{where}: give exactly one of 'tokens' (list of ints) or 'text' (string)")
    if has_tokens:
        toks = rec["tokens"]
        if not isinstance(toks, list) or not toks or not all(isinstance(t, int) and t >= 0 for t in toks):
            raise PromptError(f"{where}: 'tokens' must be a non-empty list of non-negative ints")
    elif not isinstance(rec["text"], str) or not rec["text"]:
        raise PromptError(f"{where}: 'text' must be a non-empty string")
    out = dict(rec)
    out["id"] = str(rec.get("id", f"prompt{index}"))
    out["category"] = str(rec.get("category", "default"))
    return out


def select(prompts: Sequence[dict], categories: Iterable[str] | None = None, per_category: int | None = None,
           limit: int | None = None) -> list[dict]:
    """Keep prompts of the given categories (all when None), at most `per_category` each, then `limit` in all."""
    prompts = list(prompts)
    if categories:
        wanted = list(categories)
        known = {p["category"] for p in prompts}
        unknown = [c for c in wanted if c not in known]
        if unknown:
            raise PromptError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; "
                              f"this suite has {sorted(known)}")
        prompts = [p for p in prompts if p["category"] in wanted]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            if seen[p["category"]] <= per_category:
                kept.append(p)
        prompts = kept
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise PromptError("no prompts left after --categories / --prompts-per-category / --limit")
    return prompts


def apply_template(text: str, template: str) -> str:
    """Wrap a text prompt: `template` holds one '{prompt}' placeholder (e.g. a chat template)."""
    return template.replace("{prompt}", text)


def tokenize(prompts: Sequence[dict], encode: Callable[[str], list[int]] | None, vocab_size: int,
             template: str = "{prompt}") -> list[dict]:
    """Give every prompt a "tokens" list: text through `encode`, pre-tokenized ones checked against the vocabulary."""
    out = []
    for p in prompts:
        if "tokens" in p:
            toks = list(p["tokens"])
        elif encode is None:
            raise PromptError(f"prompt {p['id']!r} is text but this model has no tokenizer: put a tokenizer.json "
                              "next to the checkpoint (needs the `tokenizers` package) or pass --prompts-file with "
                              "pre-tokenized prompts ({\"id\", \"category\", \"tokens\": [...]})")
        else:
            toks = list(encode(apply_template(p["text"], template)))
        if not toks:
            raise PromptError(f"prompt {p['id']!r} tokenizes to nothing")
        bad = [t for t in toks if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"prompt {p['id']!r} has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append({**p, "tokens": toks})
    return out


def context_files() -> list[str]:
    """The long-context filler's source: the running interpreter's standard-library `.py` files (the corpus
    the bundled tiny model was trained on, present on every machine), sorted by path relative to the
    library, site-packages excluded."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = sorted(x for x in subdirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    if not files:
        raise PromptError(f"--context: no standard-library sources under {root}")
    return sorted(files, key=lambda f: os.path.relpath(f, root))


def context_source_note() -> str:
    return f"Python {sys.version.split()[0]} standard-library .py files ({sysconfig.get_paths()['stdlib']})"


def fill_context(prompts: Sequence[dict], n_tokens: int, encode: Callable[[str], list[int]] | None,
                 bos: int | None) -> list[dict]:
    """Each tokenized prompt lengthened to n_tokens: its own tokens last, before them filler text from
    `context_files` (prompt i starts at file 31·i mod the file count and reads on, files joined by a blank
    line), after the prompt's BOS when it starts with one. Prompts already that long are kept. Adds
    "context_tokens" (the filler's length) to each prompt."""
    if encode is None:
        raise PromptError("--context needs the model's tokenizer to encode the filler text")
    files = context_files()
    out = []
    for i, p in enumerate(prompts):
        toks = list(p["tokens"])
        need = n_tokens - len(toks)
        if need <= 0:
            out.append({**p, "context_tokens": 0})
            continue
        head = toks[:1] if bos is not None and toks[:1] == [bos] else []
        filler, j = [], (31 * i) % len(files)
        while len(filler) < need:
            with open(files[j % len(files)], encoding="utf-8", errors="replace") as f:
                ids = list(encode(f.read() + "\n\n"))
            filler += ids[1:] if bos is not None and ids[:1] == [bos] else ids
            j += 1
            if j - (31 * i) % len(files) > len(files):
                raise PromptError(f"--context {n_tokens}: the standard library holds fewer tokens than that")
        out.append({**p, "tokens": head + filler[:need] + toks[len(head):], "context_tokens": need})
    return out
