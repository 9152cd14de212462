"""The accepted rows on the published asv page: ``nox -s history`` runs this after ``asv publish``.

    python src/rmsnorm_suite/acceptedpage.py [--site .asv/html] [--ledger .asv/results/accepted.json]

asv does not read the results branch's accepted.json (history.py record-accepted writes it), so
this writes its rows to accepted.html beside the page's index.html and links it from the page's
navigation bar. Standard library only; docs/ci.md, "History and drift".
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
from pathlib import Path

PAGE = "accepted.html"  # beside the page's index.html
_NAV = re.compile(r'<li id="nav-li-regressions">.*?</li>')  # asv's "Regressions" tab: ours goes after it
_LINK = f'<li id="nav-li-accepted"><a href="{PAGE}">Accepted regressions</a></li>'
_COLUMNS = ("Commit", "Pull request", "Row", "Up to", "Approved by", "Reason")
_HEAD = (
    '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
    "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\n"
    "<title>Accepted regressions</title><style>body{font-family:sans-serif;margin:2em}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}</style>"
    '</head><body>\n<p><a href="index.html">Benchmarks</a></p><h1>Accepted regressions</h1>\n'
    "<p>Rows a merged pull request's verdict accepted with a maintainer's approval (accepted.json on "
    "the asv-results branch), newest first. The reason is the pull request author's text.</p>\n"
)


def _factor(value) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    try:
        value = float(value)  # a JSON integer too large for a float: OverflowError
    except OverflowError:
        return ""
    return f"x{value:g}" if math.isfinite(value) else ""


def write(site: Path, ledger: Path) -> int:
    """Write ``site/accepted.html``, the rows of ``ledger`` (accepted.json, to which record-accepted
    appends) newest first, every string escaped (a reason is a pull request author's text), and link
    it from ``site/index.html``'s navigation bar once. An absent or empty ledger gives a page that
    says there are none; one that does not read, a page that says so. Returns the rows listed."""
    none = "<p>None: no regression accepted yet.</p>\n"
    try:
        text = ledger.read_text(encoding="utf-8") if ledger.is_file() else ""
        data = json.loads(text) if text.strip() else {}
    except (OSError, ValueError, RecursionError):
        data, none = {}, f"<p>None listed: {html.escape(ledger.name)} could not be read.</p>\n"
    listed = data.get("accepted") if isinstance(data, dict) else None
    rows = [r for r in reversed(listed) if isinstance(r, dict)] if isinstance(listed, list) else []
    cells = [
        (r.get("commit"), f"#{r['pull']}" if "pull" in r else "", r.get("check"), _factor(r.get("factor")),
         r.get("approved_by"), r.get("reason"))
        for r in rows
    ]  # fmt: skip
    table = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c or ''))}</td>" for c in row) + "</tr>\n" for row in cells
    )
    head = "".join(f"<th>{h}</th>" for h in _COLUMNS)
    body = f"<table><tr>{head}</tr>\n{table}</table>\n" if cells else none
    (site / PAGE).write_text(_HEAD + body + "</body></html>\n", encoding="utf-8")
    index = site / "index.html"
    text = index.read_text(encoding="utf-8")
    if not _NAV.search(text):
        raise ValueError(f"{index} has no Regressions tab to link {PAGE} after")
    if _LINK not in text:
        index.write_text(_NAV.sub(lambda m: m.group(0) + _LINK, text, count=1), encoding="utf-8")
    return len(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="acceptedpage.py", description=__doc__.split("\n")[0])
    parser.add_argument("--site", default=".asv/html", help="the published page's folder")
    parser.add_argument("--ledger", default=".asv/results/accepted.json", help="the accepted rows")
    args = parser.parse_args(argv)
    if not (Path(args.site) / "index.html").is_file():
        print(f"acceptedpage: no {args.site}/index.html: run asv publish first", file=sys.stderr)
        return 1
    count = write(Path(args.site), Path(args.ledger))
    print(f"acceptedpage: {args.site}/{PAGE} lists {count} accepted rows of {args.ledger}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
