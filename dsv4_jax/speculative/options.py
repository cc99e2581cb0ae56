"""The options of `generate`, in three small frozen groups, and the published keywords that fill them.

    Sampling      temperature, top_p, seed                         what is drawn
    Speculation   drafter, draft_n_max, options (the drafter's own: `Drafter.Options`)   how drafts are made
    RunShape      eos_token_id, max_len, pad_to, host_loop, max_block, drafter_pool, dynamic_draft_n,
                  prefill_chunk, adaptive_widths, round_trace
                                                                     when to stop, fixed shapes, loop driver

`generate(..., sampling=Sampling(temperature=0.8), speculation=Speculation("dspark", 5))` and
`generate(..., temperature=0.8, drafter="dspark", draft_n_max=5)` are the same call: `group_options`
routes every published keyword to its group; a keyword given with its group object overrides that field.
Any other keyword is an option of the chosen drafter (`Speculation.options`, e.g. p_min=0.3 with
drafter="mtp" is options=MTPOptions(p_min=0.3)); an option of another registered drafter is ignored
(a sweep may pass every drafter's), a name no drafter has is a TypeError naming the valid ones.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..drafters import registry


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when temperature == 0; otherwise softmax(logits / T) restricted to the top-p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Speculation:
    """drafter: a registered name (`dsv4_jax.drafters.registry`: None/"none", "mtp", "dspark", "ngram",
    "oracle", "pool", or one added with `register`).

    draft_n_max: drafts per round (DSpark: at most its block size); options: the drafter's own options
    (an instance of its `Options`, e.g. MTPOptions(p_min=0.3), DSparkOptions(confidence_threshold=0.5,
    dspark_meta=DSparkConfig(...)), NgramOptions(n_min=1, n_max=3); None: its defaults).
    verify: sampled runs' verify rule, "token" (rejection sampling) or "block" (block verification; both
    lossless, greedy runs identical); synthetic_accept: cost studies — a rate, or one per draft position,
    at which each draft is accepted as an independent Bernoulli draw instead of verified (not lossless;
    statistics marked synthetic). docs/verification.md.
    draft_n_max="auto": the width scheduler (docs/width_scheduler.md) chooses each round how many of up to
    draft_n_max_bound drafts to verify (none, or even plain decoding without the drafter), from the
    drafts' acceptance estimates and cost_table (a `speculative.cost_table.CostTable` or its JSON file;
    None: measured on this machine by a short calibration and cached).
    """

    drafter: str | None = None
    draft_n_max: int | str = 3
    options: Any = None
    verify: str = "token"
    synthetic_accept: Any = None
    cost_table: Any = None
    draft_n_max_bound: int = 7


LONG_PROMPT_CHUNK = 2048   # RunShape.prefill_chunk=None: longer prompts are prefilled in chunks of this size


@dataclasses.dataclass(frozen=True)
class RunShape:
    """eos_token_id: stop a sequence after it (None: the config's; -1: never). max_len / pad_to: fix the
    cache capacity and the padded prompt length, so that runs with other prompts reuse the compiled
    functions. host_loop: drive the rounds from Python (debugging twin; identical results).

    Sharing compiled programs across runs (research sweeps): max_block sizes the decode state and the
    loop's carry for verify blocks up to that width (default draft_n_max + 1), so runs with any
    draft_n_max < max_block share the prefill programs; drafter_pool (registered names) compiles the
    loop once per draft width for all of them, the drafter chosen at run time (`drafters.pool`), and
    makes the prefill compute every member's tap layers. Neither changes the generated tokens; the
    verify block stays draft_n_max + 1 wide. dynamic_draft_n (with max_block) goes one step further:
    every draft_n_max < max_block shares one loop program, draft_n_max a run-time bound
    (`Knobs.draft_n`): the drafter is compiled once and proposes at most draft_n_max drafts (MTP's
    chain and DSpark's Markov head run that many steps), and the verify block is still draft_n_max + 1
    wide — the verify and commit are a switch over the widths 2..max_block, one copy of the target
    step each (`speculative.round.round_step`; `ops.branch.switch_in_place`, which updates the decode state in
    place), so a round costs what it costs in its own program.
    Greedy tokens, statistics and decode states equal the static program's; sampled runs draw from the
    same distributions but other random numbers (the drafter's draws are split for the bound).
    prefill_chunk: prefill the prompts in chunks of that many tokens, one program for every padded
    prompt length (`speculative.prefill.prefill_chunk`; None: one program per length, the whole prompt at
    once up to LONG_PROMPT_CHUNK tokens, longer prompts in chunks of LONG_PROMPT_CHUNK: a block's indexer
    scores [S, H, S/m] grow with S², a chunk's with S).
    adaptive_widths (with dynamic_draft_n): compile the width scheduler into the loop program, so fixed
    draft_n_max runs share the program of draft_n_max="auto" runs (same tokens; docs/width_scheduler.md).
    round_trace: record every round's accepted and verified drafts per sequence (`stats.Trace`; the
    statistics' per_round_accepted / per_round_drafted: acceptance against the output position)."""

    eos_token_id: int | None = None
    max_len: int | None = None
    pad_to: int | None = None
    host_loop: bool = False
    max_block: int | None = None
    drafter_pool: tuple[str, ...] | None = None
    dynamic_draft_n: bool = False
    prefill_chunk: int | None = None
    adaptive_widths: bool = False
    round_trace: bool = False


GROUPS = {"sampling": Sampling, "speculation": Speculation, "run": RunShape}
# published keyword -> its group
KEYWORDS = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}


def group_options(sampling: Sampling | None = None, speculation: Speculation | None = None,
                  run: RunShape | None = None, **keywords) -> tuple[Sampling, Speculation, RunShape]:
    """The three groups, each the given object (or defaults) updated with its published keywords."""
    given = {"sampling": sampling, "speculation": speculation, "run": run}
    extra = {k: v for k, v in keywords.items() if k not in KEYWORDS}
    keywords = {k: v for k, v in keywords.items() if k in KEYWORDS}
    out = []
    for group, cls in GROUPS.items():
        obj = given[group]
        if obj is not None and not isinstance(obj, cls):
            raise TypeError(f"{group}= takes a {cls.__name__}, got {type(obj).__name__}")
        mine = {k: v for k, v in keywords.items() if KEYWORDS[k] == group}
        out.append(cls(**mine) if obj is None else dataclasses.replace(obj, **mine))
    if extra:
        out[1] = dataclasses.replace(out[1], options=drafter_options(out[1], extra))
    return tuple(out)


def drafter_options(spec: Speculation, keywords: dict):
    """spec.options updated with the keywords that are the chosen drafter's options (the others must be
    options of other registered drafters: ignored); TypeError naming the valid options otherwise."""
    drafter = registry.get(spec.drafter)
    mine = {f.name for f in dataclasses.fields(drafter.Options)}
    known = {f.name for name in registry.names() for f in dataclasses.fields(registry.get(name).Options)}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise TypeError(f"unknown generate option(s) {unknown}; the options are {sorted(KEYWORDS)}, the groups "
                        f"{sorted(GROUPS)}, and drafter {drafter.name!r}'s options {sorted(mine) or 'none'}")
    return drafter.options(spec.options, **{k: v for k, v in keywords.items() if k in mine})
