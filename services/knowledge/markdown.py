"""One markdown file of a vault: bytes -> YAML frontmatter + body, the entry's id, its first heading and its links.

Every problem with a file is a :class:`ParseError` whose message is shown to the user as the file's error (the rest
of the vault still syncs). ``extract_links`` never raises: a link it cannot make sense of is skipped.

Links are Obsidian's (``[[target]]``, ``[[target#heading|label]]``, ``![[embed]]``) and markdown's
(``[label](relative/path.md#anchor)``); they point at entry ids (:func:`entry_id` of the target file), never at
attachments (images, PDFs) or outside URLs. Fenced code blocks and inline code spans hold no links.
"""

from __future__ import annotations

import datetime
import math
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import yaml

__all__ = [
    "MAX_FILE_BYTES", "MAX_FRONTMATTER_BYTES", "MAX_ID_BYTES", "ParseError", "ParsedFile", "Link",
    "parse_markdown", "entry_id", "first_heading", "extract_links",
]

MAX_FILE_BYTES = 1024 * 1024
MAX_FRONTMATTER_BYTES = 64 * 1024
MAX_ID_BYTES = 64  # Vectorize's id limit (seed §4.2)
#: Guards against YAML alias bombs (aliases share one object; converting them would copy it every time).
MAX_FRONTMATTER_NODES = 20_000
MAX_FRONTMATTER_DEPTH = 20
MAX_RAW_LINK = 200

_BOM = b"\xef\xbb\xbf"
_TOO_BIG = "frontmatter is too large or too deeply nested"
_OPEN = re.compile(r"---[ \t]*\Z")
_CLOSE = re.compile(r"(?:---|\.\.\.)[ \t]*\Z")
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


class ParseError(Exception):
    """A per-file error: ``str(exc)`` is the reason shown to the user (e.g. "malformed YAML frontmatter: line 3: ...")."""


@dataclass(frozen=True, slots=True)
class ParsedFile:
    frontmatter: dict[str, Any]  # JSON-safe builtins, but dates stay datetime.date / datetime.datetime; {} when none
    body: str  # the markdown after the frontmatter (leading blank lines stripped)


@dataclass(frozen=True, slots=True)
class Link:
    target: str  # the target entry's id (as entry_id computes it for the target file)
    label: str | None  # the display text ([[t|label]], [label](x.md)); None when none
    raw: str  # the link as written (at most 200 characters), for reporting unresolved links


# -- bytes -> text ---------------------------------------------------------------------------------------------


def _line_of(data: bytes, offset: int) -> int:
    prefix = data[:offset].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return prefix.count(b"\n") + 1


def _decode(data: bytes) -> str:
    if len(data) > MAX_FILE_BYTES:
        raise ParseError(f"file is larger than 1 MiB ({len(data)} bytes)")
    skip = len(_BOM) if data.startswith(_BOM) else 0
    nul = data.find(b"\x00")
    if nul != -1:
        raise ParseError(f"binary file, not markdown: NUL byte at offset {nul} (line {_line_of(data, nul)})")
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start
        raise ParseError(f"not UTF-8 text: invalid byte 0x{data[at]:02X} at offset {at} (line {_line_of(data, at)})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


# -- YAML ------------------------------------------------------------------------------------------------------


_BaseLoader: Any = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


class _Loader(_BaseLoader):  # type: ignore[misc, valid-type]
    """The safe loader, but an impossible timestamp (``2024-13-45``) stays a string instead of failing the file."""


def _timestamp(loader: Any, node: yaml.Node) -> Any:
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_timestamp(loader, node)
    except (ValueError, OverflowError):
        return loader.construct_scalar(node)


_Loader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp)


def _yaml_error(exc: yaml.YAMLError) -> ParseError:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    if context:
        problem = f"{problem} ({context})"
    if mark is None:
        return ParseError(f"malformed YAML frontmatter: {problem}")
    # +1: 1-based; +1: the opening '---' line.
    return ParseError(f"malformed YAML frontmatter: line {mark.line + 2}, column {mark.column + 1}: {problem}")


class _Budget:
    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes = 0

    def take(self, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_FRONTMATTER_NODES or depth > MAX_FRONTMATTER_DEPTH:
            raise ParseError(_TOO_BIG)


def _key(key: Any) -> str:
    if key is None:
        return "null"
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, (datetime.date, datetime.datetime)):
        return key.isoformat()
    return str(key)


def _safe(value: Any, budget: _Budget, depth: int) -> Any:
    """``value`` as JSON-safe builtins (dates kept), counting nodes."""
    budget.take(depth)
    if value is None or isinstance(value, (str, bool, int, datetime.date)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {_key(k): _safe(v, budget, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe(v, budget, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return [_safe(v, budget, depth + 1) for v in sorted(value, key=str)]
    if isinstance(value, (bytes, bytearray)):
        raise ParseError("frontmatter holds binary data (!!binary), which is not supported")
    raise ParseError(f"frontmatter holds an unsupported value of type {type(value).__name__}")


def _load_frontmatter(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        loaded = yaml.load(text, Loader=_Loader)  # a safe loader: CSafeLoader or SafeLoader
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None
    except RecursionError:
        raise ParseError(_TOO_BIG) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        kind = "a list" if isinstance(loaded, list) else f"a {type(loaded).__name__}"
        kind = {"a str": "a string", "a int": "a number", "a float": "a number", "a bool": "a boolean"}.get(kind, kind)
        raise ParseError(f"frontmatter must be a mapping of fields, not {kind}")
    try:
        return _safe(loaded, _Budget(), 0)  # type: ignore[no-any-return]
    except RecursionError:
        raise ParseError(_TOO_BIG) from None


# -- file ------------------------------------------------------------------------------------------------------


def _split(text: str) -> tuple[str | None, str]:
    """(frontmatter text or None, body)."""
    first, nl, rest = text.partition("\n")
    if not _OPEN.match(first):
        return None, text
    if not nl:
        raise ParseError("frontmatter is not closed: no '---' line after the opening one")
    pos = 0
    while pos <= len(rest):
        end = rest.find("\n", pos)
        line = rest[pos:] if end == -1 else rest[pos:end]
        if _CLOSE.match(line):
            return rest[:pos], "" if end == -1 else rest[end + 1:]
        if end == -1:
            break
        pos = end + 1
    raise ParseError("frontmatter is not closed: no '---' line after the opening one")


def parse_markdown(data: bytes) -> ParsedFile:
    """Split one vault file into its frontmatter (YAML, safe-loaded) and body; :class:`ParseError` when unusable."""
    text = _decode(data)
    front, body = _split(text)
    frontmatter: dict[str, Any] = {}
    if front is not None:
        size = len(front.encode("utf-8"))
        if size > MAX_FRONTMATTER_BYTES:
            raise ParseError(f"frontmatter is larger than 64 KiB ({size} bytes)")
        frontmatter = _load_frontmatter(front)
    return ParsedFile(frontmatter=frontmatter, body=_LEADING_BLANK_LINES.sub("", body))


# -- ids -------------------------------------------------------------------------------------------------------


def entry_id(path: str) -> str:
    """The entry id of a vault file: its name without ``.md``; an ``index.md`` takes its folder's name."""
    folder, _, name = path.rpartition("/")
    stem = name[:-3] if name.endswith(".md") else name
    if stem == "index" and folder:
        stem = folder.rpartition("/")[2]
    if not stem:
        raise ParseError(f"no id can be made from the path {path[:MAX_RAW_LINK]!r}")
    if len(stem.encode("utf-8")) > MAX_ID_BYTES:
        raise ParseError(f"id '{stem[:32]}…' is longer than {MAX_ID_BYTES} bytes")
    return stem


# -- markdown structure ----------------------------------------------------------------------------------------


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)\Z")
_HEADING = re.compile(r" {0,3}#(?:[ \t]+(.*?))?[ \t]*\Z")
_CLOSING_HASHES = re.compile(r"(?:\A|[ \t]+)#+\Z")
_TICKS = re.compile(r"`+")


def _lines_outside_fences(body: str) -> Iterator[str]:
    """The lines of ``body`` not in a fenced code block (CommonMark fences; an unclosed one runs to the end)."""
    fence: str | None = None
    for line in body.split("\n"):
        m = _FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                fence = m.group(1)
                continue
            yield line
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            fence = None


def first_heading(body: str) -> str | None:
    """The text of the first level-1 ATX heading (``# Title``) outside code fences, or None."""
    for line in _lines_outside_fences(body):
        m = _HEADING.match(line)
        if m and m.group(1):
            text = _CLOSING_HASHES.sub("", m.group(1)).strip()
            if text:
                return text
    return None


# -- links -----------------------------------------------------------------------------------------------------


_WIKILINK = re.compile(r"!?\[\[([^\[\]\n]+?)\]\]")
_MD_LINK = re.compile(
    r"(!?)\[((?:[^\[\]\n]|\[[^\[\]\n]*\])*)\]"                # [label] (one level of nested brackets)
    r"\(\s*(?:<([^<>\n]*)>|((?:[^\s()]|\([^\s()]*\))+))"      # (<href>  or  (href
    r"(?:\s+(?:\"[^\"\n]*\"|'[^'\n]*'|\([^()\n]*\)))?\s*\)"   # optional "title", then )
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
#: Attachments Obsidian embeds or links (and common documents): a wikilink to one of these is not an entry link.
_ATTACHMENT_EXTENSIONS = frozenset(
    "png jpg jpeg gif bmp svg webp avif ico tif tiff heic mp3 wav m4a ogg oga flac 3gp webm mp4 m4v mov mkv ogv avi "
    "pdf canvas base excalidraw zip gz tar 7z csv tsv json yaml yml xml txt html htm doc docx xls xlsx ppt pptx odt "
    "ods odp epub key pages numbers".split()
)


def _without_code_spans(line: str) -> str:
    """``line`` with its code spans blanked: a run of n backticks opens one, the next run of exactly n closes it
    (CommonMark; an opener without a closer is literal). Linear: runs are paired through a next-of-same-length table."""
    runs = [(m.start(), m.end()) for m in _TICKS.finditer(line)]
    if len(runs) < 2:
        return line
    following: list[int | None] = [None] * len(runs)
    latest: dict[int, int] = {}
    for i in range(len(runs) - 1, -1, -1):
        length = runs[i][1] - runs[i][0]
        following[i] = latest.get(length)
        latest[length] = i
    out, pos, i = [], 0, 0
    while i < len(runs):
        j = following[i]
        if j is None:
            i += 1
            continue
        start, end = runs[i][0], runs[j][1]
        out.extend((line[pos:start], " " * (end - start)))
        pos, i = end, j + 1
    out.append(line[pos:])
    return "".join(out)


def _safe_id(path: str) -> str | None:
    try:
        return entry_id(path)
    except ParseError:
        return None


def _wikilink(inner: str) -> tuple[str, str | None] | None:
    """(target id, label) of the inside of ``[[...]]``, or None when it is no entry link."""
    target, _, label = inner.partition("|")
    target = target.removesuffix("\\")  # [[a\|b]] inside a table
    target = re.split(r"[#^]", target, maxsplit=1)[0].strip()
    if not target:
        return None
    name = target.rpartition("/")[2]
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    if ext in _ATTACHMENT_EXTENSIONS:
        return None
    target_id = _safe_id(target if target.endswith(".md") else target + ".md")
    return (target_id, label.strip() or None) if target_id else None


def _md_target(href: str, path: str) -> str | None:
    """The target id of a markdown link's href, or None when it is no relative link to a markdown file."""
    href = href.strip()
    if not href or href.startswith(("#", "//")) or _SCHEME.match(href):
        return None
    href = unquote(href.partition("#")[0])
    if not href.endswith(".md"):
        return None
    if href.startswith("/"):  # relative to the vault's root
        resolved = posixpath.normpath(href.lstrip("/"))
    else:
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), href))
    if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        return None
    return _safe_id(resolved)


def _links_in_line(line: str, path: str) -> Iterator[tuple[int, Link]]:
    for m in _WIKILINK.finditer(line):
        found = _wikilink(m.group(1))
        if found:
            yield m.start(), Link(target=found[0], label=found[1], raw=m.group(0)[:MAX_RAW_LINK])
    blanked = _WIKILINK.sub(lambda m: " " * len(m.group(0)), line)
    for m in _MD_LINK.finditer(blanked):
        target = _md_target(m.group(3) if m.group(3) is not None else m.group(4), path)
        if target:
            label = m.group(2).strip() or None
            yield m.start(), Link(target=target, label=label, raw=line[m.start():m.end()][:MAX_RAW_LINK])


def extract_links(body: str, *, path: str) -> list[Link]:
    """The links of ``body`` (a file at ``path`` in the vault) in document order, de-duplicated on (target, label)."""
    links: list[Link] = []
    seen: set[tuple[str, str | None]] = set()
    for line in _lines_outside_fences(body):
        if "[" not in line:
            continue
        for _, link in sorted(_links_in_line(_without_code_spans(line), path), key=lambda item: item[0]):
            if (link.target, link.label) not in seen:
                seen.add((link.target, link.label))
                links.append(link)
    return links
