#!/usr/bin/env bash
# The demo model's corpus: the King James Bible from Debian's bible-kjv-text (public domain: the 1611
# translation's copyright has long expired), dumped to plain text with the package's own `bible` reader.
# Usage: scripts/fetch_corpus.sh OUT_DIR   -> OUT_DIR/kjv.txt (one verse per line)
set -euo pipefail
out=${1:?usage: fetch_corpus.sh OUT_DIR}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download bible-kjv-text bible-kjv >/dev/null)
for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/root"; done
# Whole book, unformatted; wrapped lines are joined and verse numbers dropped below.
"$tmp/root/usr/bin/bible" -p "$tmp/root/usr/lib" "gen1:1-rev22:21" > "$tmp/raw.txt"
python3 - "$tmp/raw.txt" "$out/kjv.txt" <<'PY'
import re
import sys

verses, cur = [], None
for line in open(sys.argv[1], encoding="latin-1"):
    line = line.rstrip("\n")
    m = re.match(r"^\s+(\d+) (.*)$", line)
    if m:
        if cur:
            verses.append(cur)
        cur = m.group(2).strip()
    elif line.strip() and cur is not None and not re.match(r"^[0-9A-Z][A-Za-z ]* \d+$", line.strip()):
        cur += " " + line.strip()
    elif not line.strip() and cur:
        verses.append(cur)
        cur = None
if cur:
    verses.append(cur)
open(sys.argv[2], "w", encoding="utf-8").write("\n".join(verses) + "\n")
print(f"{len(verses)} verses -> {sys.argv[2]}")
PY
