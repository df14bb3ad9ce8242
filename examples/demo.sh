#!/usr/bin/env bash
# The main job: lint the bundled examples, then run two small training scripts under the
# runtime guard (a healthy one and one that overflows in fp16) and leave reports to open.
set -euo pipefail
source "$(dirname "$0")/../.ci/install"
cd "$repo"

echo "== python -m flake8 --select=AMP examples/"
# flake8 exits 1 when it reports findings, which is the point here; anything else is an error.
lint_status=0
python -m flake8 --select=AMP examples/ || lint_status=$?
if [ "$lint_status" -gt 1 ]; then
    exit "$lint_status"
fi

echo
echo "== python -m amp_runtime run --out amp-report/healthy examples/train_healthy.py"
python -m amp_runtime run --out amp-report/healthy examples/train_healthy.py

echo
echo "== python -m amp_runtime run --out amp-report/overflow examples/train_overflow.py"
python -m amp_runtime run --out amp-report/overflow examples/train_overflow.py

echo
echo "Reports:"
echo "  $repo/amp-report/healthy/report.html"
echo "  $repo/amp-report/overflow/report.html"
