"""Rewrite the result tables of docs/*.md from their JSON (compactrl/docs_tables.py); run after a
bench or study writes new results. `--check` only lists the pages whose tables differ (exit 1)."""

import argparse
import sys
from pathlib import Path

from compactrl.docs_tables import sync

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="list stale tables, change nothing")
    args = p.parse_args()
    pages = sorted((ROOT / "docs").glob("*.md"))
    stale = {page: s for page in pages if (s := sync(page, ROOT, write=not args.check))}
    for page, specs in stale.items():
        print(f"{page.relative_to(ROOT)}: {'stale' if args.check else 'rewrote'} {', '.join(specs)}")
    sys.exit(1 if stale and args.check else 0)
