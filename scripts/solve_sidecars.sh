#!/usr/bin/env bash
# Solve the committed ② sidecars of ds4-tiny, one papermill run of notebooks/sidecar.ipynb per domain:
# the sidecar goes to models/sidecars/<domain>/, the executed report and its JSON summary to
# papermill_runs/sidecar__domain=<domain>__<yyyymmdd>-<commit>.{ipynb,json}. Each report evaluates its sidecar
# on all six judging slices (the bare base beside it), so the five reports hold the 5 x 6 table.
#   bash scripts/solve_sidecars.sh [domain ...]      (default: finance code law medicine science)
# Extra papermill parameters through PM_ARGS, e.g. PM_ARGS="-p windows 8".
set -euo pipefail
cd "$(dirname "$0")/.."
set -a; . scripts/numerics.env; set +a      # the pinned numeric environment (same bits on any AVX2 machine)
domains=("$@")
[ ${#domains[@]} -gt 0 ] || domains=(finance code law medicine science)
tag="$(date -u +%Y%m%d)-$(git rev-parse --short HEAD)"
judge='["finance/judge", "code/judge", "law/judge", "medicine/judge", "science/judge", "english/judge"]'
for d in "${domains[@]}"; do
    run="papermill_runs/sidecar__domain=${d}__${tag}"
    echo "== $d -> models/sidecars/$d, $run.ipynb"
    .venv/bin/papermill notebooks/sidecar.ipynb "$run.ipynb" --cwd . \
        -p base models/ds4-tiny-base.gguf -p checkpoint models/ds4-tiny -p domain "$d" \
        -y "{fit: [\"$d/fit\"], judge_slices: $judge}" -p out "models/sidecars/$d" \
        -p summary_json "$run.json" ${PM_ARGS:-}
done
