#!/usr/bin/env bash
# Install what tests/test_browser.py needs that pip cannot: Debian's Chromium at /usr/bin/chromium.
# Idempotent: does nothing when Chromium is already there. Playwright's Python package comes
# from the project's dev extra; its own browser downloads are never used (these machines
# cannot download a browser build), the test launches this Chromium by path.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    echo "chromium: already installed ($(/usr/bin/chromium --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y chromium
/usr/bin/chromium --version
