#!/usr/bin/env bash
# Speed-up vs synthetic acceptance rate x draft_n_max on the bundled tiny model (docs/verification.md §5):
# one dsv4-sweep per rate (none + MTP at draft_n_max 1-4, one shared loop program per rate), then the table.
#   PYTHONPATH=. bash experiments/synthetic_acceptance.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
for r in 0.3 0.6 0.9; do
  python -m dsv4_jax.research.sweep --spec none,mtp --draft-n-max 1-4 --synthetic-accept "$r" \
    --prompts-per-category 1 --max-new-tokens 48 --repeats 2 --quiet --out "$out/rate_$r" --overwrite
done
python experiments/synthetic_table.py "$out"/rate_*
