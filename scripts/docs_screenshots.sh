#!/usr/bin/env bash
# The documentation site as a reader sees it: build it (mkdocs build --strict), serve it on
# 127.0.0.1, and take headless-Chromium screenshots of the home page and a study page.
# Needs chromium (Debian: apt-get install chromium) and the docs extra (pip install -e '.[docs]').
# Usage: bash scripts/docs_screenshots.sh [OUT_DIR]      (default: docs/screenshots)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/screenshots}
site=$(mktemp -d)
trap 'kill $server 2>/dev/null; rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
port=8765
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" > /dev/null 2>&1 &
server=$!
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/" > /dev/null && break; sleep 0.1; done
mkdir -p "$out"
for page in "home:" "sidequest_replicate:sidequest_replicate/"; do
  name=${page%%:*}
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
    --screenshot="$out/$name.png" "http://127.0.0.1:$port/${page#*:}" 2> /dev/null
  echo "wrote $out/$name.png"
done
