"""Research CLIs: `dsv4-sweep` (draft-n-max / p_min / confidence / temperature / batch sweeps) and
`dsv4-batch-eval` (batched throughput and latency), with JSON, markdown and matplotlib outputs;
`dsv4-long-context` (cost against the context length) and `dsv4-bench-decode` (the decode path of a
Flash-shaped model against its bytes bound, the GPU suite's benchmark).

Modules: prompts (suites, JSONL files, tokenization), models (model selection), runner (timed,
fixed-shape generation), report (aggregates, tables, plots, atomic output), sweep, batch_eval,
long_context, bench_decode.
"""
