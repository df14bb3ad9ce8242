#!/usr/bin/env bash
# The whole test suite: installs what it needs (see .ci/install, then tests/requirements.txt),
# then runs pytest.
set -euo pipefail
source "$(dirname "$0")/../.ci/install"
cd "$repo"
# The frameworks in tests/requirements.txt depend on torch too: hold it at the installed build.
torch_pin="$(mktemp)"
python -c "import torch; print(f'torch=={torch.__version__}')" > "$torch_pin"
python -m pip install --quiet --disable-pip-version-check -c "$torch_pin" \
    -r tests/requirements.txt
rm -f "$torch_pin"
# CI checks report.html in a real browser (tests/test_report_browser.py): Debian's chromium.
if [ -n "${CI:-}" ] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium; } >/dev/null 2>&1 \
        || echo "warning: chromium could not be installed; the browser tests will skip" >&2
fi
status=0
python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
fi
exit "$status"
