#!/usr/bin/env bash
# Ablations of the ② sidecar solver on one domain (issue 11): the default solve beside one change at a time,
# each solved on the first W fitting windows and scored on the domain's judging slice and general English.
#   bash bench/sidecar_ablations.sh [domain] [windows]        (default: finance 8)
# Results: bench/results/sidecar_ablations_<domain>.json (one row per variant: solve report + five numbers).
set -euo pipefail
cd "$(dirname "$0")/.."
d=${1:-finance}; W=${2:-8}
base=models/ds4-tiny-base.gguf
work=cache/ablations/$d
mkdir -p "$work" bench/results
declare -A flags=(
  [default]=""
  [gains_only]="--no-router-bias"
  [float_then_round]="--float-then-round"
  [own_ridge]="--own-ridge"
  [no_gate]="--gate 0"
)
for v in ${VARIANTS:-default gains_only float_then_round own_ridge no_gate}; do
    echo "== $v"
    start=$(date +%s.%N)
    .venv/bin/ds4 sidecar --base $base --domain "$d" --fit "$d/fit" --windows "$W" --out "$work/$v" --fresh --quiet \
        --json "$work/$v.solve.json" ${flags[$v]}
    end=$(date +%s.%N)
    echo "{\"wall_seconds\": $(echo "$end - $start" | bc)}" > "$work/$v.wall.json"
    .venv/bin/ds4 eval -m $base --zchain "$work/$v" --slice "$d/judge" --slice english/judge --json --out "$work/$v.eval.json" > /dev/null
done
.venv/bin/ds4 eval -m $base --slice "$d/judge" --slice english/judge --json --out "$work/bare.eval.json" > /dev/null
.venv/bin/python - "$d" "$work" <<'PY'
import json, sys
from pathlib import Path
d, work = sys.argv[1], Path(sys.argv[2])
rows = {"bare": {"eval": json.loads((work / "bare.eval.json").read_text())}}
for v in ("default", "gains_only", "float_then_round", "own_ridge", "no_gate"):
    if not (work / f"{v}.eval.json").exists():
        continue
    s = json.loads((work / f"{v}.solve.json").read_text())
    rows[v] = {"eval": json.loads((work / f"{v}.eval.json").read_text()), "wall_seconds":
               json.loads((work / f"{v}.wall.json").read_text())["wall_seconds"], "bytes": s["bytes"],
               "mounted": [r["layer"] for r in s["layers"] if r["gains"]],
               "biased": [r["layer"] for r in s["layers"] if r["bias"]],
               "heldout_gain": [round(r.get("heldout_gain") or 0, 4) for r in s["layers"]], "params": s["params"]}
out = Path(f"bench/results/sidecar_ablations_{d}.json")
out.write_text(json.dumps(rows, indent=1))
print("wrote", out)
PY
