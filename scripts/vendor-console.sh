#!/usr/bin/env bash
# Refresh the console's browser libraries from web/console/package-lock.json (npm ci) and copy their
# built files into tether/console/static/vendor, which is committed: pages need no build on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/../web/console"
npm ci --no-audit --no-fund
vendor=../../tether/console/static/vendor
mkdir -p "$vendor"
cp node_modules/htmx.org/dist/htmx.min.js "$vendor/htmx.min.js"
cp node_modules/htmx-ext-sse/dist/sse.min.js "$vendor/htmx-sse.min.js"
cp node_modules/uplot/dist/uPlot.iife.min.js "$vendor/uPlot.iife.min.js"
cp node_modules/uplot/dist/uPlot.min.css "$vendor/uPlot.min.css"
for pkg in htmx.org htmx-ext-sse uplot; do
  cp "node_modules/$pkg/LICENSE" "$vendor/LICENSE.$pkg" 2>/dev/null || true
done
echo "vendored into tether/console/static/vendor:"
ls -l "$vendor"
