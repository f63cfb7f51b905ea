#!/usr/bin/env bash
# The README's main job. Until the trainer lands: a few single-process steps of the tiny GPT.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
exec "$PYTHON" tools/demo_foundation.py
