"""Which files of a source a knowledge base reads: include / exclude globs, and release folders.

Glob syntax (git's, as in .gitignore patterns anchored at the root): ``*`` matches within one path segment,
``**`` any number of segments (``**/`` zero or more folders), ``?`` one character, ``[abc]`` a class.
The defaults take every markdown file but those under ``drafts/`` and dot-folders (``.obsidian/``,
``.github/``...). ``index.base`` files are read whatever the globs say: they mark release folders.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

from services.errors import InvalidInput

__all__ = ["DEFAULT_INCLUDE", "DEFAULT_EXCLUDE", "RELEASE_MARKER", "check_globs", "selected", "excluded", "is_marker",
           "release_folders", "release_of"]

DEFAULT_INCLUDE = ("**/*.md",)
DEFAULT_EXCLUDE = ("drafts/**", ".*/**", "**/.*/**")
RELEASE_MARKER = "index.base"
MAX_GLOBS = 50


@lru_cache(maxsize=512)
def _compile(glob: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = glob.find("]", i + 1)
            if end == -1:
                raise InvalidInput(f"glob {glob!r}: unclosed [", details={"field": "source.include"})
            body = glob[i + 1:end].replace("\\", "\\\\")
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def check_globs(globs: object, field: str) -> tuple[str, ...]:
    if not isinstance(globs, (list, tuple)) or len(globs) > MAX_GLOBS:
        raise InvalidInput(f"{field} must be a list of at most {MAX_GLOBS} globs", details={"field": field})
    out = []
    for g in globs:
        if not isinstance(g, str) or not g.strip() or len(g) > 300 or g.startswith("/"):
            raise InvalidInput(f"{field}: each glob is a relative path pattern of 1-300 characters",
                               details={"field": field})
        try:
            _compile(g)
        except re.error as exc:
            raise InvalidInput(f"{field}: bad glob {g!r}: {exc}", details={"field": field}) from None
        out.append(g)
    return tuple(out)


def _any(globs: Iterable[str], path: str) -> bool:
    return any(_compile(g).match(path) for g in globs)


def is_marker(path: str) -> bool:
    return path == RELEASE_MARKER or path.endswith("/" + RELEASE_MARKER)


def excluded(path: str, exclude: Sequence[str]) -> bool:
    return _any(exclude, path)


def selected(path: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Whether ``path`` becomes an entry (markdown only, whatever the globs)."""
    return path.endswith(".md") and _any(include, path) and not _any(exclude, path)


def release_folders(paths: Iterable[str], exclude: Sequence[str]) -> set[str]:
    """Folders holding an ``index.base`` (not excluded), e.g. ``docs/dao-primitives/toolkit``."""
    return {p.rpartition("/")[0] for p in paths if is_marker(p) and not _any(exclude, p)}


def release_of(path: str, folders: set[str]) -> str | None:
    """The innermost release folder holding ``path``."""
    folder = path.rpartition("/")[0]
    while folder:
        if folder in folders:
            return folder
        folder = folder.rpartition("/")[0]
    return None
