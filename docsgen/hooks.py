"""mkdocs hook: a line `<!-- reference: NAME -->` on a page becomes the reference generated from the code.

NAME is `configuration`, `cli` or `metrics` (`docsgen.reference.GENERATORS`); any other name fails the build,
and so does a config key without a description.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the hook is loaded by file path; the reference reads this tree's proxy/
    sys.path.insert(0, str(ROOT))

from docsgen.reference import GENERATORS  # noqa: E402

MARKER = re.compile(r"^<!-- reference: ([a-z]+) -->$", re.MULTILINE)


def expand(markdown: str) -> str:
    """The page with every reference marker replaced by its generated Markdown."""

    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown reference {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(generated, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return expand(markdown)
