"""Research CLIs: `dsv4-sweep` (draft-n-max / p_min / confidence / temperature / batch sweeps) and
`dsv4-batch-eval` (batched throughput and latency), with JSON, markdown and matplotlib outputs.

Modules: prompts (suites, JSONL files, tokenization), models (model selection), runner (timed,
fixed-shape generation), report (aggregates, tables, plots, atomic output), sweep, batch_eval.
"""
