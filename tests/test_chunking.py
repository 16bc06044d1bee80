"""Paragraph-aware chunking (design §3.2), with the hashing counter and the real MiniLM tokenizer."""

from __future__ import annotations

import random
import re
from itertools import pairwise

import pytest

from services.adapters.hash_embedder import HashEmbedder
from services.adapters.onnx_embedder import OnnxMiniLMEmbedder, load_tokenizer_json
from services.text.chunking import chunk_spans, chunk_text, default_chunk_params

TOPICS = "retention billing onboarding latency backups invoices search tenants quotas alerts".split()
VERBS = "covers explains changes delays improves breaks documents replaces".split()


@pytest.fixture(scope="module")
def minilm() -> OnnxMiniLMEmbedder:
    return OnnxMiniLMEmbedder()  # only the tokenizer is loaded by count_tokens


@pytest.fixture(scope="module")
def model_tokens():
    """Tokens the model really gets for a chunk, [CLS] and [SEP] included, by the shipped tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(load_tokenizer_json())
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode(text).ids)


@pytest.fixture(params=["hash", "minilm"], scope="module")
def counter(request, minilm):
    return HashEmbedder().count_tokens if request.param == "hash" else minilm.count_tokens


def sentence(rng: random.Random, ident: str, words: int | None = None) -> str:
    n = words if words is not None else rng.randint(4, 16)
    body = " ".join(rng.choice(TOPICS + VERBS + ["the", "a", "of", "and"]) for _ in range(n))
    return f"Point {ident} {rng.choice(VERBS)} {body}."


def paragraph(rng: random.Random, ident: str, sentences: int) -> str:
    return " ".join(sentence(rng, f"{ident}.{k}") for k in range(sentences))


def sentences_of(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=\.)\s+", text.strip()) if s]


def overlap_len(previous: str, following: str) -> int:
    """Length of the longest suffix of ``previous`` that ``following`` starts with."""
    for n in range(min(len(previous), len(following)), 0, -1):
        if previous.endswith(following[:n]):
            return n
    return 0


def check_invariants(text: str, counter, max_tokens: int, overlap_tokens: int) -> list[str]:
    spans = chunk_spans(text, count_tokens=counter, max_tokens=max_tokens, overlap_tokens=overlap_tokens)
    chunks = chunk_text(text, count_tokens=counter, max_tokens=max_tokens, overlap_tokens=overlap_tokens)
    assert chunks == [text[a:b] for a, b in spans]
    if not text.strip():
        assert chunks == []
        return chunks
    assert spans[0][0] == len(text) - len(text.lstrip())
    assert spans[-1][1] == len(text.rstrip())
    for (a, b), (c, d) in pairwise(spans):
        assert a < c and b < d  # moving forward; a chunk never contains its predecessor
        assert not text[b:c].strip(), "nothing between two chunks is left out"
    for chunk in chunks:
        assert chunk and chunk == chunk.strip()
        assert counter(chunk) <= max_tokens
    return chunks


# ---------------------------------------------------------------------------- parameters


def test_default_chunk_params():
    assert default_chunk_params(OnnxMiniLMEmbedder()) == (254, 31)
    assert default_chunk_params(HashEmbedder()) == (254, 31)

    assert default_chunk_params(HashEmbedder(max_tokens=512)) == (510, 63)  # bge's limit


# ---------------------------------------------------------------------------- short notes


@pytest.mark.parametrize("text", ["", "   \n\n\t  "])
def test_blank_note_has_no_chunks(counter, text):
    assert chunk_text(text, count_tokens=counter, max_tokens=254, overlap_tokens=31) == []


def test_short_note_is_one_chunk_equal_to_the_stripped_text(counter):
    rng = random.Random(1)
    note = "\n\n  # Title\n\n" + paragraph(rng, "a", 3) + "\n\n- item one\n- item two\n\n" + paragraph(rng, "b", 2) + "\n \n"
    assert counter(note) <= 254
    assert chunk_text(note, count_tokens=counter, max_tokens=254, overlap_tokens=31) == [note.strip()]


def test_note_of_exactly_the_budget_is_one_chunk(counter):
    rng = random.Random(2)
    note = "\n\n".join(paragraph(rng, str(i), 2) for i in range(12))
    budget = counter(note)
    assert chunk_text(note, count_tokens=counter, max_tokens=budget, overlap_tokens=8) == [note]
    assert len(chunk_text(note, count_tokens=counter, max_tokens=budget - 1, overlap_tokens=8)) > 1


# ---------------------------------------------------------------------------- long notes


def test_long_note_is_packed_by_paragraph_with_overlap(counter):
    rng = random.Random(3)
    paragraphs = [paragraph(rng, f"p{i}", rng.randint(2, 5)) for i in range(40)]
    note = "\n\n".join(paragraphs)
    max_tokens, overlap = 254, 31
    chunks = check_invariants(note, counter, max_tokens, overlap)

    assert len(chunks) >= 4
    assert sum(counter(c) for c in chunks) / len(chunks) > max_tokens * 0.6  # packed, not one per paragraph
    for p in paragraphs:  # each paragraph fits, so none is split
        assert any(p in chunk for chunk in chunks), p[:40]
    for s in sentences_of(note):  # and nothing is lost
        assert any(s in chunk for chunk in chunks), s
    for previous, following in pairwise(chunks):
        shared = overlap_len(previous, following)
        assert 0 < shared < len(previous), "neighbours share their boundary text"
        assert counter(following[:shared]) <= overlap
        assert following.startswith("Point"), "the overlap is whole trailing sentences"


def paragraph_of_about(rng: random.Random, ident: str, counter, tokens: int) -> str:
    sentences: list[str] = []
    while counter(" ".join(sentences)) <= tokens:
        sentences.append(sentence(rng, f"{ident}.{len(sentences)}"))
    return " ".join(sentences)


def test_paragraph_that_does_not_fit_what_is_left_opens_the_next_chunk(counter):
    rng = random.Random(4)
    small = paragraph(rng, "small", 2)
    big = paragraph_of_about(rng, "big", counter, 150)
    big2 = paragraph_of_about(rng, "huge", counter, 150)
    assert counter(big) + counter(big2) > 254
    note = "\n\n".join([small, big, big2, paragraph(rng, "tail", 2)])
    chunks = check_invariants(note, counter, 254, 31)
    assert chunks[0] == small + "\n\n" + big
    assert big2 in chunks[1]


def test_giant_paragraph_is_split_on_sentences(counter):
    rng = random.Random(5)
    giant = " ".join(sentence(rng, f"s{k}") for k in range(150))  # no blank line at all
    chunks = check_invariants(giant, counter, 254, 31)
    assert len(chunks) >= 5
    for chunk in chunks:
        assert chunk.endswith("."), "chunks end at sentence boundaries"
        assert chunk.startswith("Point"), "chunks (and their overlaps) start at sentence boundaries"
    for s in sentences_of(giant):
        assert any(s in chunk for chunk in chunks), s


def test_giant_sentence_is_split_between_words(counter):
    rng = random.Random(6)
    words = [f"{rng.choice(TOPICS)}{k}" for k in range(2000)]
    giant = " ".join(words)
    chunks = check_invariants(giant, counter, 254, 31)
    assert len(chunks) > 3
    split = set()
    for chunk in chunks:
        split.update(chunk.split())
    assert split == set(words), "no word is cut in two"


def test_giant_word_blob_is_split_too(counter):
    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+/"
    blob = "".join(rng.choice(alphabet) for _ in range(12000))
    note = "Attached key material:\n\n" + blob + "\n\nEnd of note."
    chunks = check_invariants(note, counter, 254, 0)
    assert sum(1 for c in chunks if set(c) <= set(alphabet)) >= 2, "the blob is cut into windows"
    # Without overlap the chunks are disjoint and cover the note.
    assert re.sub(r"\s+", "", "".join(chunks)) == re.sub(r"\s+", "", note)


def test_chunks_fit_the_model_with_its_special_tokens(minilm, model_tokens):
    rng = random.Random(8)
    parts = []
    for i in range(30):
        parts.append(paragraph(rng, f"u{i}", rng.randint(1, 9)) + " naïve café — “quoted” 漢字 ok")
    note = "\n\n".join(parts) + "\n\n" + "x/" * 3000
    max_tokens, overlap = default_chunk_params(minilm)
    chunks = check_invariants(note, minilm.count_tokens, max_tokens, overlap)
    assert max(model_tokens(c) for c in chunks) <= minilm.max_tokens


def test_chunking_is_deterministic(counter):
    rng = random.Random(9)
    note = "\n\n".join(paragraph(rng, f"d{i}", rng.randint(1, 12)) for i in range(30))
    first = chunk_text(note, count_tokens=counter, max_tokens=254, overlap_tokens=31)
    assert first == chunk_text(note, count_tokens=counter, max_tokens=254, overlap_tokens=31)


def test_random_notes_keep_the_invariants(counter):
    rng = random.Random(10)
    pieces = [
        lambda: paragraph(rng, str(rng.random())[2:6], rng.randint(1, 6)),
        lambda: " ".join(f"w{rng.randint(0, 99999)}" for _ in range(rng.randint(50, 600))),
        lambda: "".join(rng.choice("ab01+/=") for _ in range(rng.randint(50, 1500))),
        lambda: "漢字のテキスト。" * rng.randint(1, 40) + " naïve — “ok”",
        lambda: "\n".join(f"- item {k}" for k in range(rng.randint(1, 60))),
    ]
    for _ in range(25):
        note = "".join(
            rng.choice(pieces)() + rng.choice(["\n\n", "\n", " ", "\n \n\n", "\t"])
            for _ in range(rng.randint(1, 15))
        )
        max_tokens = rng.choice([8, 30, 126, 254])
        check_invariants(note, counter, max_tokens, rng.choice([0, max_tokens // 8, max_tokens // 2]))


def test_twenty_kilobyte_note_chunks_quickly(minilm):
    """Chunking does work linear in the note: the text it hands the token counter (the costly part) adds up
    to a few times the note, never a recount per piece (measured in work, not in wall-clock time)."""
    rng = random.Random(11)
    note = "\n\n".join(paragraph(rng, f"t{i}", rng.randint(1, 8)) for i in range(200))[:20000]
    max_tokens, overlap = default_chunk_params(minilm)
    counted: list[int] = []

    def count(text: str) -> int:
        counted.append(len(text))
        return minilm.count_tokens(text)

    chunks = chunk_text(note, count_tokens=count, max_tokens=max_tokens, overlap_tokens=overlap)
    assert len(chunks) > 10
    assert sum(counted) <= 4 * len(note), (len(counted), sum(counted))  # about 2.6x today
    assert len(counted) <= 10 * len(chunks)


def test_rejects_a_zero_budget():
    with pytest.raises(ValueError):
        chunk_text("text", count_tokens=len, max_tokens=0, overlap_tokens=0)
