"""Deterministic text helpers for enrichment: tag normalisation against a vocabulary, the extractive
one-line summary, keyphrase tags and the importance heuristic. No model, no I/O: same input, same output.

Tags
    ``normalize_tag``: ASCII-folded (``Café`` -> ``cafe``), lower case, every run of other characters one
    ``-`` (``Vector DB``, ``vector_db``, ``vector.db`` -> ``vector-db``), at most 4 words and 40 characters.
    ``tag_key``: the form two spellings share when they differ only in separators or number:
    ``vector-databases``, ``vector-database``, ``vectordatabase`` -> ``vectordatabase``.
    ``canonical_tags``: normalises a list, maps each tag to the vocabulary's spelling when one shares its
    key (the vocabulary is ordered most-used first, so its first spelling wins), drops duplicates, keeps order.

Extractive summary (no LLM)
    The first meaningful line of the note (front matter, code fences, rules, images and link-only lines
    skipped; heading marks, list bullets, quote marks, emphasis and link syntax stripped), its first sentence
    when that is long enough to stand alone, cut to 140 characters on a word boundary with an ellipsis.

Keyphrase tags (no LLM)
    Vocabulary tags whose words occur in the note (as a phrase, in any number) come first, most-used first;
    then RAKE: candidate phrases are the runs of words between stop words and punctuation (1-3 words, no bare
    numbers), each scored by the sum of its words' degree/frequency; ties break by first occurrence. The
    phrases become tags through ``canonical_tags``; 3-7 are returned when the text has that many.

Importance heuristic (no LLM), 1-5
    Starts at 3. +1 when the note states a commitment (decision, decided, agreed, must, required, deadline,
    due, important, policy, never, always ...); +1 when it reports something serious (incident, outage,
    breach, security, vulnerability, critical, urgent, data loss, postmortem, production). -1 for a note
    that carries only low-stakes cues (maybe, someday, fyi, random, trivia, idea, lol) or is under six words
    without any raising cue.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

__all__ = [
    "normalize_tag",
    "tag_key",
    "canonical_tags",
    "extractive_summary",
    "keyphrases",
    "keyphrase_tags",
    "vocabulary_matches",
    "heuristic_importance",
    "clip",
    "SUMMARY_MAX",
]

SUMMARY_MAX = 140
TAG_MAX_CHARS = 40
TAG_MAX_WORDS = 4

STOP_WORDS = frozenset(
    """a about above after again against all also am an and any are aren as at be because been before being
    below between both but by can cannot could couldn did didn do does doesn doing don down during each either
    else etc even ever every few for from further get gets got had has have having he her here hers herself him
    himself his how however i if in into is isn it its itself just let lets like made make many may me might
    more most much must my myself need needs no nor not now of off on once one only or other others our ours
    ourselves out over own per please put quite rather re really said same say says see seem seems shall she
    should since so some still such than that the their theirs them themselves then there these they this
    those though through thus to too two under until up upon us use used uses using very via was wasn way we
    well were weren what when where whether which while who whom whose why will with within without won would
    yes yet you your yours yourself yourselves new today tomorrow yesterday thing things something anything
    lot lots want wants go going gone know think thought""".split()
)
# Common verbs: never a topic on their own, and they end a candidate phrase.
_VERBS = frozenset(
    """add added adds ask asked build built call called change changed check checked come comes create created
    decide decided do done feel felt find found fix fixed follow follows give given handle handles handled
    help helps keep keeps kept leave left look looked move moved pick picked plan planned read remember run
    runs ran send sent set sets show shows start started stop stopped take takes took tell test tested tests
    tried try turn turned wait work worked works write wrote migrate migrated agree agreed emit emits
    emitted need needed buy bought get""".split()
)


# -- tags ----------------------------------------------------------------------------------------------

def _ascii(text: str) -> str:
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def normalize_tag(raw: object) -> str | None:
    """kebab-case, lower, ASCII; None when nothing usable is left."""
    if not isinstance(raw, str):
        return None
    text = _ascii(raw).lower().strip().lstrip("#")
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if not text:
        return None
    words = text.split("-")[:TAG_MAX_WORDS]
    out = ""
    for w in words:
        cand = f"{out}-{w}" if out else w
        if len(cand) > TAG_MAX_CHARS:
            break
        out = cand
    if not out or out.isdigit():
        return None
    return out


def _singular(word: str) -> str:
    if len(word) <= 3 or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "shes", "ches", "xes", "zes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is", "os")):
        return word[:-1]
    return word


def tag_key(tag: str) -> str:
    """What two spellings of one tag share (separators dropped, each word singular)."""
    return "".join(_singular(w) for w in tag.split("-"))


def canonical_tags(raw: Iterable[object], vocabulary: Sequence[str] = (), *, limit: int = 7) -> list[str]:
    """Normalise, map to the vocabulary's spelling, de-duplicate; at most ``limit``."""
    by_key: dict[str, str] = {}
    for v in vocabulary:
        n = normalize_tag(v)
        if n:
            by_key.setdefault(tag_key(n), n)
    out: list[str] = []
    seen: set[str] = set()
    for r in raw:
        n = normalize_tag(r)
        if not n:
            continue
        k = tag_key(n)
        if k in seen:
            continue
        seen.add(k)
        out.append(by_key.get(k, n))
        if len(out) >= limit:
            break
    return out


# -- summary -------------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_WIKI = re.compile(r"\[\[([^\]|]*)(?:\|([^\]]*))?\]\]")
_URL = re.compile(r"https?://\S+")
_EMPH = re.compile(r"(\*\*|__|\*|_|~~|`)(?=\S)(.+?)(?<=\S)\1")
_BULLET = re.compile(r"^\s*(?:[-*+]\s+(?:\[[ xX]\]\s+)?|\d+[.)]\s+|>\s*)+")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def clip(text: str, limit: int = SUMMARY_MAX) -> str:
    """``text`` on one line, cut to ``limit`` characters on a word boundary (an ellipsis marks the cut)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:-–—") + "…"


def _clean_line(line: str) -> str:
    line = _HEADING.sub("", line)
    line = _BULLET.sub("", line)
    line = _WIKI.sub(lambda m: m.group(2) or m.group(1), line)
    line = _LINK.sub(lambda m: m.group(1), line)
    line = _URL.sub("", line)
    for _ in range(2):
        line = _EMPH.sub(lambda m: m.group(2), line)
    line = re.sub(r"\s#+\s*$", "", line)  # closing heading marks
    return " ".join(line.split()).strip()


def _meaningful_lines(text: str) -> list[str]:
    lines = text.replace("\r\n", "\n").split("\n")
    out: list[str] = []
    i = 0
    if lines and lines[0].strip() == "---":  # YAML front matter
        for j in range(1, len(lines)):
            if lines[j].strip() in ("---", "..."):
                i = j + 1
                break
    fence = False
    for line in lines[i:]:
        s = line.strip()
        if s.startswith(("```", "~~~")):
            fence = not fence
            continue
        if fence or not s:
            continue
        if re.fullmatch(r"[-*_=~#\s|:+]{3,}", s) or s.startswith("<!--"):
            continue
        cleaned = _clean_line(s)
        if sum(c.isalnum() for c in cleaned) < 2:
            continue
        out.append(cleaned)
    return out


def extractive_summary(text: str, limit: int = SUMMARY_MAX) -> str | None:
    lines = _meaningful_lines(text)
    if not lines:
        return None
    first = lines[0]
    sentences = _SENTENCE_END.split(first)
    summary = sentences[0] if len(sentences[0].split()) >= 4 else first
    return clip(summary, limit) or None


# -- keyphrases ----------------------------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9+#.'-]*[A-Za-z0-9+#]|[A-Za-z0-9]")
_SPLIT = re.compile(r"[.,;:!?()\[\]{}\"“”‘’<>|/\\=*~^`\n\r\t]+|\s[-–—]+\s")


def _words(text: str) -> list[str]:
    return [w.lower().replace("'", "") for w in _WORD.findall(_ascii(text))]


def keyphrases(text: str, *, max_words: int = 2) -> list[str]:
    """Candidate topic phrases, best first (deterministic).

    Runs of words between stop words and punctuation give the candidates: each word and each pair of
    neighbours (up to ``max_words``). A word weighs its count in the note, plus 1.5 when it is in the note's
    first line (the title, usually); a phrase weighs the mean of its words, times 1.5 when the whole phrase
    occurs more than once, and a bare word under four letters half. Best first, pairs before single words on
    ties, then by first occurrence; a phrase sharing a word with a better one is left out, so the list is
    diverse.
    """
    lines = _meaningful_lines(text)
    if not lines:
        return []
    title = set(_words(lines[0]))
    runs: list[list[str]] = []
    for fragment in _SPLIT.split(_ascii("\n".join(lines))):
        current: list[str] = []
        for w in _words(fragment):
            if w in STOP_WORDS or w in _VERBS or len(w) < 2 or w.replace(".", "").isdigit():
                if current:
                    runs.append(current)
                current = []
            else:
                current.append(w)
        if current:
            runs.append(current)
    count: dict[str, int] = {}
    for run in runs:
        for w in run:
            count[w] = count.get(w, 0) + 1
    weight = {w: c + (1.5 if w in title else 0.0) for w, c in count.items()}
    cands: dict[tuple[str, ...], list] = {}  # phrase -> [occurrences, first position]
    pos = 0
    for run in runs:
        for i in range(len(run)):
            for n in range(1, max_words + 1):
                if i + n <= len(run):
                    ph = tuple(run[i : i + n])
                    entry = cands.setdefault(ph, [0, pos])
                    entry[0] += 1
            pos += 1
    scored = []
    for ph, (occ, first) in cands.items():
        score = sum(weight[w] for w in ph) / len(ph)
        if len(ph) > 1 and occ > 1:
            score *= 1.5
        if len(ph) == 1 and len(ph[0]) < 4:
            score *= 0.5
        scored.append((-score, -len(ph), first, ph))
    scored.sort()
    out: list[str] = []
    used: set[str] = set()
    for _, _, _, ph in scored:
        if used.intersection(ph):
            continue
        used.update(ph)
        out.append(" ".join(ph))
    return out


def vocabulary_matches(text: str, vocabulary: Sequence[str]) -> list[str]:
    """Vocabulary tags whose words occur in ``text`` as a phrase (in any number), in vocabulary order."""
    words = [_singular(w) for w in _words(text)]
    joined = " " + " ".join(words) + " "
    squashed = "".join(words)
    out = []
    for tag in vocabulary:
        parts = [_singular(p) for p in tag.split("-") if p]
        if not parts:
            continue
        if f" {' '.join(parts)} " in joined or (len(parts) > 1 and "".join(parts) in words) or \
                (len(parts) == 1 and len(parts[0]) >= 6 and parts[0] in squashed and f" {parts[0]} " in joined):
            out.append(tag)
    return out


def keyphrase_tags(text: str, vocabulary: Sequence[str] = (), *, want: int = 5, limit: int = 7) -> list[str]:
    """3-7 tags without a model: vocabulary tags present in the text first, then RAKE phrases."""
    reused = vocabulary_matches(text, vocabulary)[:want]
    taken = {_singular(w) for t in reused for w in t.split("-")}
    phrases = [p for p in keyphrases(text) if not taken.intersection(_singular(w) for w in p.split())]
    candidates = reused + [p.replace(" ", "-") for p in phrases]
    tags = canonical_tags(candidates, vocabulary, limit=limit)
    return tags[: max(want, min(len(reused), limit))]


# -- importance ----------------------------------------------------------------------------------------

_COMMIT = re.compile(
    r"\b(decision|decided|decide|agreed|agreement|must|required|requirement|deadline|due (?:by|on|date)|"
    r"important|importantly|policy|never|always|commit(?:ted|ment)?|promise[ds]?|contract|sign(?:ed)? off|"
    r"approved|mandatory|blocker|blocking)\b",
    re.IGNORECASE,
)
_SERIOUS = re.compile(
    r"\b(incident|outage|breach|security|vulnerabilit(?:y|ies)|cve-\d+|critical|urgent|asap|data loss|"
    r"post-?mortem|production|prod down|sev[ -]?[01]|p0|emergency|leak(?:ed)?|compromised)\b",
    re.IGNORECASE,
)
_LOW = re.compile(r"\b(maybe|someday|fyi|random|trivia|idea|lol|just a thought|nice to have|musing)\b", re.IGNORECASE)


def heuristic_importance(text: str) -> int:
    score = 3
    commit, serious = bool(_COMMIT.search(text)), bool(_SERIOUS.search(text))
    score += int(commit) + int(serious)
    if not (commit or serious) and (_LOW.search(text) or len(_words(text)) < 6):
        score -= 1
    return max(1, min(5, score))
