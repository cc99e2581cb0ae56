"""Argument parsing, pre-flight checks and cost tables shared by `dsv4-sweep`, `dsv4-whatif` and `dsv4-batch-eval`."""
from __future__ import annotations

import argparse
from typing import Sequence

from tqdm.auto import tqdm

from .. import cli
from ..cli import OptionError, enable_compile_cache, float_list, int_list  # noqa: F401 - the research CLIs' names
from ..analysis import roofline
from ..speculative.cost_table import CostTable, CostTableError
from . import prompts as P
from .runner import SPEC_TYPES, SweepPlan, Setting, calibrate_setting, shapes

AUTO = "auto"       # --draft-n-max: the width scheduler (docs/width_scheduler.md)
DEFAULT_BOUND = 7   # --draft-n-max-bound

def spec_list(text: str) -> list[str]:
    specs = [s.strip().lower() for s in text.split(",") if s.strip()]
    unknown = [s for s in specs if s not in SPEC_TYPES]
    if unknown or not specs:
        raise OptionError(f"--spec: unknown spec type(s) {unknown or [text]}; choose from {', '.join(SPEC_TYPES)}")
    return list(dict.fromkeys(specs))


def add_prompt_args(p: argparse.ArgumentParser, default_per_category: int | None) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--suite", choices=sorted(P.SUITE_FILES),
                   help="bundled prompt suite (default: 'tiny' for byte-level models, 'mtp-bench' otherwise)")
    g.add_argument("--prompts-file", metavar="JSONL",
                   help='prompts, one JSON object a line: {"id", "category", "tokens": [...]} (pre-tokenized) or '
                        '{"id", "category", "text"} (through the model\'s tokenizer); replaces --suite')
    g.add_argument("--categories", metavar="A,B", help="only these categories (comma-separated)")
    default = "all" if default_per_category is None else str(default_per_category)
    g.add_argument("--prompts-per-category", type=int, default=default_per_category, metavar="N",
                   help=f"at most N prompts per category (default {default})")
    g.add_argument("--full-suite", action="store_true", help="every prompt of the suite (overrides "
                                                             "--prompts-per-category)")
    g.add_argument("--limit", type=int, metavar="N", help="at most N prompts in all")
    g.add_argument("--context", type=int, metavar="N",
                   help="long-context runs: fill each prompt to N tokens, its own text last, before it text of the "
                        "Python standard library's source files (`dsv4_jax.research.prompts.fill_context`)")
    g.add_argument("--prompt-template", default="{prompt}", metavar="TPL",
                   help="wrap text prompts, '{prompt}' is replaced (e.g. a chat template: "
                        "'<｜User｜>{prompt}<｜Assistant｜>'); default: the raw text")


def add_run_args(p: argparse.ArgumentParser, default_repeats: int = 3) -> None:
    g = p.add_argument_group("generation and measurement")
    g.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="tokens to generate per prompt (default: the suite's, 64 for 'tiny', 192 for 'mtp-bench')")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for temperature > 0 (default 1)")
    g.add_argument("--ignore-eos", action="store_true", help="never stop at EOS (every run generates exactly "
                                                             "--max-new-tokens)")
    g.add_argument("--seed", type=int, default=42, help="sampling seed, the same for every setting (default 42)")
    g.add_argument("--repeats", type=int, default=default_repeats,
                   help=f"timed repeats per batch; the median is reported with the min and max (default "
                        f"{default_repeats}; the warm-up run is never timed)")
    g.add_argument("--prompt-buckets", type=int, default=2, metavar="N",
                   help="pad prompts to at most N lengths, chosen to minimise padding (each is one prefill "
                        "compilation; default 2)")
    g.add_argument("--no-shared-programs", action="store_true",
                   help="compile each setting on its own (no shared max_block / drafter pool); for comparison")
    cli.add_compile_cache(g)
    o = p.add_argument_group("output")
    cli.add_out_dir(o)
    o.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    cli.add_quiet(o, "no per-prompt lines or progress bar")


def check_common(a: argparse.Namespace) -> None:
    """Model-independent checks of the shared options (raises OptionError)."""
    for name in ("max_new_tokens", "prompts_per_category", "limit", "prompt_buckets", "context"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if a.repeats < 1:
        raise OptionError(f"--repeats must be >= 1, got {a.repeats}")
    if not 0 < a.top_p <= 1:
        raise OptionError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.seed < 0:
        raise OptionError(f"--seed must be >= 0, got {a.seed}")
    if "{prompt}" not in a.prompt_template:
        raise OptionError("--prompt-template must contain '{prompt}'")
    if a.prompts_file and a.suite:
        raise OptionError("give --suite or --prompts-file, not both")


def read_prompt_source(a: argparse.Namespace) -> list[dict] | None:
    """The prompts file's records (checked now), or None when the suite is decided by the model."""
    return P.read_prompts_file(a.prompts_file) if a.prompts_file else None


def resolve_prompts(a: argparse.Namespace, model, file_prompts: list[dict] | None) -> tuple[str, list[dict], int]:
    """(suite name, tokenized prompts, default max_new_tokens) for the loaded model."""
    per_cat = None if a.full_suite else a.prompts_per_category
    cats = [c.strip() for c in a.categories.split(",") if c.strip()] if a.categories else None
    if file_prompts is not None:
        suite, chosen, max_new = a.prompts_file, P.select(file_prompts, cats, per_cat, a.limit), 64
    else:
        data = P.load_suite(a.suite or model.default_suite)
        suite, max_new = data["name"], data["max_new_tokens"]
        chosen = P.select(data["prompts"], cats, per_cat, a.limit)
    prompts = P.tokenize(chosen, model.encode, model.config.vocab_size, a.prompt_template)
    if a.context:
        limit, new = model.config.max_position_embeddings, a.max_new_tokens or max_new
        if a.context + new > limit:
            raise OptionError(f"--context {a.context} + {new} new tokens is past the {limit} positions the model "
                              "supports (max_position_embeddings)")
        prompts = P.fill_context(prompts, a.context, model.encode, model.config.bos_token_id)
    return suite, prompts, max_new


def eos_for(a: argparse.Namespace) -> int | None:
    return -1 if a.ignore_eos else None


def progress(total: int, quiet: bool, desc: str):
    return tqdm(total=total, desc=desc, disable=True if quiet else None, dynamic_ncols=True, leave=False)


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """--verify and --synthetic-accept (docs/verification.md), shared by dsv4-sweep and dsv4-batch-eval."""
    g = p.add_argument_group("verification (docs/verification.md)")
    g.add_argument("--verify", default="token", choices=("token", "block"),
                   help="sampled runs' verify rule: token-wise rejection sampling or block verification (Sun et al. "
                        "2024); both lossless, greedy runs identical (default token)")
    g.add_argument("--synthetic-accept", metavar="R",
                   help="cost study: accept each draft as an independent Bernoulli(R) draw instead of verifying it "
                        "(one rate, or comma-separated rates per draft position, the last repeating); the real "
                        "programs run, the acceptance is synthetic and reported as such")


def verify_options(a: argparse.Namespace) -> tuple[str, tuple[float, ...] | None]:
    """(verify rule, synthetic rates or None) from add_verify_args's options (raises OptionError)."""
    rates = None
    if getattr(a, "synthetic_accept", None):
        rates = tuple(float_list(a.synthetic_accept, "--synthetic-accept", 0.0, 1.0))
    return getattr(a, "verify", "token"), rates


def add_width_args(g: argparse._ArgumentGroup) -> None:
    """--draft-n-max-bound, --cost-table / --roofline and --recalibrate: the width scheduler's options
    (--draft-n-max auto; docs/width_scheduler.md), shared by dsv4-sweep and dsv4-batch-eval. --roofline's
    value is parsed here (`roofline.machine`: a bad one exits 2 before any model loads)."""
    g.add_argument("--draft-n-max-bound", type=int, default=None, metavar="K",
                   help=f"--draft-n-max auto: the most drafts a round may verify (default: the widest fixed "
                        f"--draft-n-max, or {DEFAULT_BOUND} for 'auto' alone; "
                        "`auto` alone means 1-K,auto)")
    source = g.add_mutually_exclusive_group()
    source.add_argument("--cost-table", metavar="FILE",
                        help="--draft-n-max auto: a cost table JSON (seconds per round for 0..K drafts and plain "
                             "decoding; `dsv4_jax.speculative.cost_table`) for every auto setting; default: "
                             "measured per drafter, batch size and greedy/sampled by a short calibration on the "
                             "run's own program, cached under ~/.cache/dsv4_jax/cost_tables")
    source.add_argument("--roofline", metavar="MACHINE", type=cli.arg_type(roofline.machine, "machine"),
                        help="--draft-n-max auto: price every auto setting by a bandwidth roofline of MACHINE "
                             "instead (bytes a round reads / its bandwidth + a fixed cost per round, per drafter "
                             "and batch size at the run's mean context; docs/width_scheduler.md §4): "
                             f"{', '.join(sorted(roofline.MACHINES))}, or NAME:GBPS[:FIXED_US] (default fixed "
                             f"{roofline.DEFAULT_FIXED_US:g} us, assumed)")
    g.add_argument("--recalibrate", action="store_true",
                   help="--draft-n-max auto: measure the cost tables again, ignoring the cache")


def draft_n_max_list(text: str, bound: int) -> tuple[list[int], bool]:
    """--draft-n-max: fixed widths and whether `auto` is among them -> (sorted widths, auto). 'auto' alone
    means 1-bound,auto (the fixed widths reported beside auto). Raises OptionError."""
    parts = [t.strip().lower() for t in text.split(",") if t.strip()]
    auto = AUTO in parts
    fixed = [t for t in parts if t != AUTO]
    if not auto:
        return int_list(text, "--draft-n-max", 1), False
    try:
        ks = int_list(",".join(fixed), "--draft-n-max", 1) if fixed else list(range(1, bound + 1))
    except OptionError as e:
        raise OptionError(f"{e} (--draft-n-max takes integers, ranges like 1-5 and 'auto')") from None
    return ks, True


def width_options(a: argparse.Namespace) -> tuple[list[int], int | None, CostTable | None]:
    """(fixed draft_n_max values, the auto bound or None without `auto`, the --cost-table's table or None),
    checked before any model work (raises OptionError naming the problem). --roofline's machine stays in
    a.roofline: its tables need the model and are built per setting (`roofline_table`)."""
    if a.draft_n_max_bound is None:
        fixed = [t for t in a.draft_n_max.split(",") if t.strip() and t.strip().lower() != AUTO]
        try:
            a.draft_n_max_bound = max(int_list(",".join(fixed), "--draft-n-max", 1)) if fixed else DEFAULT_BOUND
        except OptionError:
            a.draft_n_max_bound = DEFAULT_BOUND      # the list's own error comes below
    if a.draft_n_max_bound < 1:
        raise OptionError(f"--draft-n-max-bound must be >= 1, got {a.draft_n_max_bound}")
    try:
        ks, auto = draft_n_max_list(a.draft_n_max, a.draft_n_max_bound)
    except OptionError as e:
        raise OptionError(f"{e}; or 'auto' for the width scheduler") from None
    roof = getattr(a, "roofline", None)
    if (a.cost_table or a.recalibrate or roof) and not auto and not getattr(a, "what_if", False):
        raise OptionError("--cost-table, --roofline and --recalibrate need 'auto' in --draft-n-max")
    if (a.cost_table or roof) and a.recalibrate:
        raise OptionError(f"give {'--cost-table' if a.cost_table else '--roofline'} or --recalibrate, not both")
    table = None
    if a.cost_table:
        try:
            table = CostTable.load(a.cost_table)
        except CostTableError as e:
            raise OptionError(f"--cost-table: {e}") from None
        widest = max(ks) if getattr(a, "what_if", False) else a.draft_n_max_bound
        if table.bound < widest:
            raise OptionError(f"--cost-table: {a.cost_table} prices up to {table.bound} drafts per round, "
                              f"{'the widest --draft-n-max' if getattr(a, 'what_if', False) else '--draft-n-max-bound'} is {widest}")
    return ks, a.draft_n_max_bound if auto else None, table


def run_context(prompt_lengths: list[int], new_tokens: list[int]) -> int:
    """The context a roofline table prices a run at: the mean prompt length + half the mean new tokens
    (the middle of the decode)."""
    return round(sum(prompt_lengths) / len(prompt_lengths) + sum(new_tokens) / len(new_tokens) / 2)


def roofline_table(model, setting, machine, context: int) -> CostTable:
    """--roofline's table for an auto setting: `analysis.roofline.table` of the model (its config, weight format,
    drafter shapes and DSpark block size) for the setting's drafter, batch size and bound at `context`."""
    setup = model.draft_setup(setting.spec, setting.draft_n_max)
    return roofline.table(model.config, setting.spec, setting.batch_size, setting.draft_n_max, machine,
                               context=context, fmt=roofline.weight_format(model.params),
                               dspark_block=getattr(setup.settings, "block_size", None),
                               drafter_specs=roofline.specs_of(model.config, setting.spec, model.params))


def cost_tables(model, prompts: list[dict], settings: Sequence[Setting], plan: SweepPlan, *,
                given: CostTable | None = None, machine: roofline.Machine | None = None, recalibrate: bool = False,
                log=None, progress=None) -> dict:
    """The cost table of every auto setting's (drafter, batch size, greedy) (`Setting.table_key`): given
    (--cost-table's), machine's roofline (--roofline: `common.roofline_table` at the prompts' mean length + half
    the new tokens), or the cached / measured calibration of the setting's own program at its first batch shape
    (recalibrate: measured again). log: where each table is printed when obtained (None: nowhere); progress: the
    calibration's progress lines (None: none).
    -> {key: {"table": CostTable, "how": "given" | "roofline" | "cached" | "measured"}}."""
    log = log or (lambda s: None)
    out = {}
    for s in settings:
        if not s.auto or s.table_key in out:
            continue
        if given is not None:
            out[s.table_key] = {"table": given, "how": "given"}
        elif machine is not None:
            context = run_context([len(p["tokens"]) for p in prompts], [plan.max_new_tokens])
            out[s.table_key] = {"table": roofline_table(model, s, machine, context), "how": "roofline"}
        else:
            log(f"== cost table for {s.spec} B={s.batch_size} {'greedy' if s.temperature == 0 else 'sampled'}: "
                f"{'calibrating' if recalibrate else 'cached or calibrating'}")
            table, how = calibrate_setting(model, shapes(prompts, s.batch_size, plan)[0], s, plan,
                                           refresh=recalibrate, progress=progress)
            out[s.table_key] = {"table": table, "how": how}
        log("\n".join([f"== cost table ({out[s.table_key]['how']}) for {s.spec} B={s.batch_size} "
                       f"{'greedy' if s.temperature == 0 else 'sampled'}:", *out[s.table_key]["table"].lines()]))
    return out
