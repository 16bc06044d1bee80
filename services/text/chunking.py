"""Paragraph-aware chunking of notes before embedding (design §3.2).

* A note of at most ``max_tokens`` tokens is one chunk: the stripped text, unchanged.
* Otherwise the note is split on blank lines into paragraphs, and paragraphs are packed into chunks
  until the budget is reached. A paragraph that fits in a chunk is never split: when it does not fit
  in what is left of the current chunk it starts the next one.
* Only a paragraph larger than the budget is split, on sentence ends (and single line breaks); a
  sentence larger than the budget is split between words; a "word" larger than the budget (a URL, a
  base64 blob) between characters.
* Adjacent chunks overlap by about ``overlap_tokens``: a chunk starts with the trailing pieces
  (whole paragraphs or sentences, else the trailing sentences or words of the last one) of the
  previous chunk. The overlap gives way to the budget: a chunk never exceeds ``max_tokens``.

Every chunk is a contiguous, stripped span of the input (formatting inside it is preserved;
``chunk_spans`` gives the offsets), every chunk has ``count_tokens(chunk) <= max_tokens`` (checked
with ``count_tokens`` on the final string, so it holds even for a counter that is not additive over
concatenation), no chunk is empty, chunks move forward (none contains its predecessor), nothing but
whitespace between two chunks is left out, and the result depends only on the arguments.

Cost: tokens are counted once per paragraph (and per sentence only inside oversized paragraphs);
chunk sizes are sums of those counts, confirmed by one count of each final chunk. Word and character
cuts are found by interpolation search, a handful of counts per cut. With the MiniLM counter a 20 KB
note chunks in ~2-3 ms.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["chunk_text", "chunk_spans", "default_chunk_params"]

TokenCounter = Callable[[str], int]

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
# A sentence ends after terminal punctuation (plus closing quotes/brackets) followed by whitespace,
# after CJK terminal punctuation, or at a single line break (lists, code, addresses).
_SENTENCE_END = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*(?=\s)|[\u3002\uff01\uff1f]+|\n")
_NON_SPACE_RUN = re.compile(r"\S+")


class _HasMaxTokens(Protocol):
    max_tokens: int


@dataclass(frozen=True, slots=True)
class _Piece:
    """A stripped span ``text[start:end]`` of one paragraph, with its token count."""

    start: int
    end: int
    tokens: int
    para: int


def default_chunk_params(embedder: _HasMaxTokens) -> tuple[int, int]:
    """``(max_tokens, overlap_tokens)`` for an embedder: room for [CLS]/[SEP], overlap of 1/8."""
    max_tokens = embedder.max_tokens - 2
    return max_tokens, max_tokens // 8


def chunk_text(
    text: str,
    *,
    count_tokens: TokenCounter,
    max_tokens: int,
    overlap_tokens: int,
) -> list[str]:
    """Split ``text`` into chunks of at most ``max_tokens`` tokens (see the module docstring)."""
    spans = chunk_spans(
        text, count_tokens=count_tokens, max_tokens=max_tokens, overlap_tokens=overlap_tokens
    )
    return [text[a:b] for a, b in spans]


def chunk_spans(
    text: str,
    *,
    count_tokens: TokenCounter,
    max_tokens: int,
    overlap_tokens: int,
) -> list[tuple[int, int]]:
    """Like :func:`chunk_text`, as ``(start, end)`` offsets into ``text`` (``text[start:end]``)."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    overlap_tokens = max(0, min(overlap_tokens, max_tokens // 2))
    a, b = _trim(text, 0, len(text))
    if a == b:
        return []

    paragraphs = _paragraph_spans(text, a, b)
    para_tokens = [count_tokens(text[pa:pb]) for pa, pb in paragraphs]
    if sum(para_tokens) <= 2 * max_tokens:
        # One paragraph is the whole (trimmed) text: its count is the text's.
        whole = para_tokens[0] if paragraphs == [(a, b)] else count_tokens(text[a:b])
        if whole <= max_tokens:
            return [(a, b)]

    pieces = _pieces(text, paragraphs, para_tokens, count_tokens, max_tokens)
    return _pack(text, pieces, count_tokens, max_tokens, overlap_tokens)


# ---------------------------------------------------------------------------- splitting


def _trim(s: str, start: int, end: int) -> tuple[int, int]:
    while start < end and s[start].isspace():
        start += 1
    while end > start and s[end - 1].isspace():
        end -= 1
    return start, end


def _split_spans(s: str, start: int, end: int, separator: re.Pattern[str], keep_separator: bool) -> list[tuple[int, int]]:
    """Trimmed, non-empty spans of ``s[start:end]`` between matches of ``separator`` (which ends the span
    before it when ``keep_separator``, as a sentence keeps its full stop)."""
    spans: list[tuple[int, int]] = []
    for match in separator.finditer(s, start, end):
        a, b = _trim(s, start, match.end() if keep_separator else match.start())
        if a < b:
            spans.append((a, b))
        start = match.end()
    a, b = _trim(s, start, end)
    if a < b:
        spans.append((a, b))
    return spans


def _paragraph_spans(s: str, start: int, end: int) -> list[tuple[int, int]]:
    return _split_spans(s, start, end, _PARAGRAPH_BREAK, keep_separator=False)


def _sentence_spans(s: str, start: int, end: int) -> list[tuple[int, int]]:
    return _split_spans(s, start, end, _SENTENCE_END, keep_separator=True)


def _pieces(
    s: str,
    paragraphs: list[tuple[int, int]],
    para_tokens: list[int],
    count: TokenCounter,
    budget: int,
) -> list[_Piece]:
    pieces: list[_Piece] = []
    for para, ((a, b), tokens) in enumerate(zip(paragraphs, para_tokens, strict=True)):
        if tokens <= budget:
            pieces.append(_Piece(a, b, tokens, para))
            continue
        for sa, sb in _sentence_spans(s, a, b):
            sentence_tokens = count(s[sa:sb])
            if sentence_tokens <= budget:
                pieces.append(_Piece(sa, sb, sentence_tokens, para))
            else:
                for wa, wb, wt in _hard_split(s, sa, sb, count, budget):
                    pieces.append(_Piece(wa, wb, wt, para))
    return pieces


def _hard_split(
    s: str, start: int, end: int, count: TokenCounter, budget: int
) -> list[tuple[int, int, int]]:
    """Windows of ``s[start:end]`` of at most ``budget`` tokens: between words, else characters."""
    out: list[tuple[int, int, int]] = []
    pos = start
    while True:
        pos, end = _trim(s, pos, end)
        if pos >= end:
            return out
        # A window that holds more than the budget (or all that is left), so the search stays local.
        limit = min(end, pos + max(8 * budget, 64))
        tokens = count(s[pos:limit])
        while tokens <= budget and limit < end:
            limit = min(end, pos + 2 * (limit - pos))
            tokens = count(s[pos:limit])
        if tokens <= budget:
            out.append((pos, end, tokens))
            return out
        cuts = [
            m.end()
            for m in _NON_SPACE_RUN.finditer(s, pos, limit)
            if m.end() < limit or limit == end or s[limit].isspace()
        ]
        cut, cut_tokens = _longest_fitting_prefix(s, pos, cuts, count, budget, limit, tokens)
        if cut is None:  # the first word alone is over budget: cut inside it
            chars = range(pos + 1, limit + 1)
            cut, cut_tokens = _longest_fitting_prefix(s, pos, chars, count, budget, limit, tokens)
            if cut is None:  # a single character over budget: nothing smaller exists
                cut, cut_tokens = pos + 1, count(s[pos : pos + 1])
        a, b = _trim(s, pos, cut)
        out.append((a, b, cut_tokens))
        pos = cut


def _longest_fitting_prefix(
    s: str,
    pos: int,
    cuts: Sequence[int],
    count: TokenCounter,
    budget: int,
    over_at: int,
    over_tokens: int,
) -> tuple[int | None, int]:
    """A cut in ``cuts`` (ascending, all <= ``over_at``) with ``count(s[pos:cut]) <= budget``."""
    return _largest_fitting(cuts, lambda cut: s[pos:cut], count, budget, pos, over_at, over_tokens)


def _largest_fitting(
    sizes: Sequence[int],
    text_of: Callable[[int], str],
    count: TokenCounter,
    budget: int,
    zero: int,
    over_size: int,
    over_tokens: int,
) -> tuple[int | None, int]:
    """The largest size in ``sizes`` (ascending) whose ``text_of(size)`` fits ``budget`` tokens.

    Or one within a 1/16 slack of the budget. ``text_of(zero)`` is empty and ``text_of(over_size)``
    (``over_size`` >= every size) holds ``over_tokens > budget`` tokens. Interpolation steps (tokens
    grow about linearly with characters) alternate with bisection steps, so that a few counts
    usually suffice and ``2 * log2(len(sizes))`` always do.
    """
    lo, lo_size, lo_tokens = -1, zero, 0
    hi, hi_size, hi_tokens = len(sizes), over_size, over_tokens
    slack = budget // 16
    goal = budget - slack // 2
    interpolate = True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if interpolate and hi_tokens > lo_tokens:
            target = lo_size + (hi_size - lo_size) * (goal - lo_tokens) / (hi_tokens - lo_tokens)
            mid = min(max(bisect_right(sizes, target, lo + 1, hi) - 1, lo + 1), hi - 1)
        interpolate = not interpolate
        tokens = count(text_of(sizes[mid]))
        if tokens <= budget:
            lo, lo_size, lo_tokens = mid, sizes[mid], tokens
            if tokens >= budget - slack:
                break
        else:
            hi, hi_size, hi_tokens = mid, sizes[mid], tokens
    if lo < 0:
        return None, 0
    return sizes[lo], lo_tokens


# ---------------------------------------------------------------------------- packing


def _pack(
    s: str,
    pieces: list[_Piece],
    count: TokenCounter,
    budget: int,
    overlap: int,
) -> list[tuple[int, int]]:
    chunks: list[tuple[int, int]] = []
    n = len(pieces)
    i = 0  # first piece not yet in any chunk
    prev_first = 0  # first new piece of the previous chunk
    while i < n:
        # The overlap first: the tail of the previous chunk, at most ``overlap`` tokens, and less
        # when the first new piece (a whole paragraph, perhaps) needs the room.
        start, tokens = pieces[i].start, 0
        room = min(overlap, budget - pieces[i].tokens)
        if chunks and room > 0:
            start, tokens = _overlap_tail(s, pieces, prev_first, i, count, room)
        # Then whole pieces while they fit. A paragraph that fits the budget is one piece, so it is
        # never split: when it does not fit in what is left, it opens the next chunk.
        j = i
        while j < n and tokens + pieces[j].tokens <= budget:
            tokens += pieces[j].tokens
            j += 1
        j = max(j, i + 1)  # always true already (each piece fits); guarantees progress regardless
        end = pieces[j - 1].end
        # The sums above assume the counter is additive over whitespace joins; make sure.
        while count(s[start:end]) > budget:
            if start != pieces[i].start:
                start = pieces[i].start  # drop the overlap first
            elif j - 1 > i:
                j -= 1  # then give pieces back to the next chunk
                end = pieces[j - 1].end
            else:
                break  # a single piece, counted on its own: it fits
        chunks.append((start, end))
        prev_first, i = i, j
    return chunks


def _overlap_tail(
    s: str, pieces: list[_Piece], prev_first: int, i: int, count: TokenCounter, room: int
) -> tuple[int, int]:
    """Start and tokens of the longest tail of the previous chunk (pieces ``prev_first..i-1``)
    that fits ``room``: whole pieces, else trailing sentences or words of the last piece. The
    tail never covers all of the previous chunk's new pieces: a chunk never contains its predecessor.
    """
    k, acc = i, 0
    while k - 1 > prev_first and acc + pieces[k - 1].tokens <= room:
        acc += pieces[k - 1].tokens
        k -= 1
    if k < i:
        return pieces[k].start, acc
    # The last piece alone is too big: its trailing sentences, else its trailing words.
    last = pieces[i - 1]
    end = last.end
    window = max(last.start, end - 16 * room)  # the tail that fits lies near the end

    def longest_tail(starts: list[int]) -> tuple[int, int] | None:
        lengths = [end - a for a in reversed(starts) if a > last.start]  # ascending
        length, tokens = _largest_fitting(
            lengths, lambda n: s[end - n : end], count, room, 0, end - last.start, last.tokens
        )
        return None if length is None else (end - length, tokens)

    sentence_starts = [a for a, _ in _sentence_spans(s, last.start, end) if a >= window]
    tail = longest_tail(sentence_starts)
    if tail is None:  # the last sentence is too long: its trailing words
        word_from = max([window, *sentence_starts])
        word_starts = [m.start() for m in _NON_SPACE_RUN.finditer(s, word_from, end)]
        if word_starts and word_starts[0] == word_from and not (
            word_from == last.start or word_from in sentence_starts or s[word_from - 1].isspace()
        ):
            word_starts = word_starts[1:]  # the window begins mid-word
        tail = longest_tail(word_starts)
    return (pieces[i].start, 0) if tail is None else tail
