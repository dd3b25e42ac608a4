#!/usr/bin/env bash
# Calibrate the cost model for Llama-3.1-8B on one H200, then check it against a real replay.
# One command on the GPU machine, from the repository root, with the `real` extra installed
# (a CUDA build of torch and triton). About 5 minutes: the full grid (~130 shapes that fit in
# the KV cache, 2 warm-ups and 5 repeats each), then a 200-request slice of the bundled trace.
#
#   scripts/calibrate_h200.sh                # writes profiles/h200-llama-3.1-8b.{json,csv}
#   SIM=.venv/bin/sim LIMIT=100 scripts/calibrate_h200.sh
set -euo pipefail

SIM=${SIM:-.venv/bin/sim}
MODEL=${MODEL:-Llama-3.1-8B}
PROFILE=${PROFILE:-profiles/h200-llama-3.1-8b.json}
LIMIT=${LIMIT:-200}
OUT=${OUT:-runs/compare-h200-llama-3.1-8b}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$SIM" calibrate --model "$MODEL" --device cuda --grid full --warmup 2 --repeats 5 --out "$PROFILE" --overwrite
"$SIM" compare traces/samples/azure_conv_2023_first5min.csv --limit "$LIMIT" --policy chunked \
    --model "$MODEL" --device cuda --profile "$PROFILE" --out "$OUT" --overwrite
