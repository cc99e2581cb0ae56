#!/usr/bin/env bash
# Issue #38's acceptance runs on the bundled tiny model (docs/width_scheduler.md): the width scheduler beside
# every fixed draft_n_max 1..7 and no speculation, MTP and DSpark, greedy and T = 0.8 (dsv4-sweep, B = 1), and
# continuous batching at B = 8 (dsv4-batch-eval). Cost tables measured fresh (--recalibrate).
#   PYTHONPATH=. bash experiments/width_scheduler.sh OUT_DIR [REPEATS]
set -euo pipefail
out=${1:?OUT_DIR}
repeats=${2:-3}
python -m dsv4_jax.research.sweep --spec none,mtp,dspark --draft-n-max 1-7,auto --draft-n-max-bound 7 \
  --temperature 0,0.8 --prompts-per-category 1 --repeats "$repeats" --recalibrate --quiet --out "$out/sweep" --overwrite
python -m dsv4_jax.research.batch_eval --spec none,mtp,dspark --draft-n-max 1-7,auto --draft-n-max-bound 7 \
  --batch-size 8 --schedule continuous --num-prompts 16 --repeats "$repeats" --recalibrate --quiet \
  --out "$out/batch" --overwrite
