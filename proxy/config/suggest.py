"""The near match of a word among the ones a place allows ("did you mean"): for a config key or an enum value
(`loader.py`, `schema.py`) and for a tool a policy names (`tasks/services/tool_names.py`). Pure; imports only the
standard library."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Final

_CUTOFF: Final = 0.6  # difflib's ratio a near match needs: `hots` → `host`, `requried` → `required`


def near(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to `word`, when one is close enough (case is ignored)."""
    by_folded = {choice.casefold(): choice for choice in choices}
    found = difflib.get_close_matches(word.casefold(), by_folded, n=1, cutoff=_CUTOFF)
    return by_folded[found[0]] if found else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the near match of `word`, else an empty string: what an error ends with."""
    match = near(word, choices)
    return f" (did you mean {match!r}?)" if match is not None and match != word else ""
