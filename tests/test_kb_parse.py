"""Knowledge bases, one vault file at a time: markdown parsing (frontmatter, ids, headings, links) and the ontology
(content types, per-field validation, path map, aliases, settings). Plain unit tests, no server."""

from __future__ import annotations

import datetime
import time

import msgspec
import pytest

from services.errors import InvalidInput
from services.knowledge.markdown import (
    MAX_FILE_BYTES, MAX_FRONTMATTER_BYTES, Link, ParseError, entry_id, extract_links, first_heading, parse_markdown,
)
from services.knowledge.ontology import (
    CONTENT_STRUCTS, CONTENT_TYPES, DEFAULT_PATH_TYPES, DEFAULT_TYPE_ALIASES, PARENT_TYPES, UNION_TYPES, Content,
    Ontology,
)


def md(text: str) -> bytes:
    return text.encode("utf-8")


def parse_error(data: bytes) -> str:
    with pytest.raises(ParseError) as info:
        parse_markdown(data)
    return str(info.value)


# -- frontmatter -----------------------------------------------------------------------------------------------


def test_frontmatter_found_with_dates_kept_and_body_after_it():
    parsed = parse_markdown(md("---\ntitle: Cell Governance\ndate: 2024-03-01\npublish: yes\ntags: [dao, cells]\n---\n\n\n"
                               "# Cell Governance\n\nText.\n"))
    assert parsed.frontmatter == {"title": "Cell Governance", "date": datetime.date(2024, 3, 1), "publish": True,
                                  "tags": ["dao", "cells"]}
    assert parsed.body == "# Cell Governance\n\nText.\n"


def test_frontmatter_datetime_kept_as_datetime():
    parsed = parse_markdown(md("---\nat: 2024-03-01 10:30:00\n---\n"))
    assert parsed.frontmatter["at"] == datetime.datetime(2024, 3, 1, 10, 30)


def test_no_frontmatter_is_an_empty_mapping_and_the_whole_text_is_the_body():
    parsed = parse_markdown(md("# Title\n\ntitle: not frontmatter\n---\n"))
    assert parsed.frontmatter == {}
    assert parsed.body == "# Title\n\ntitle: not frontmatter\n---\n"


@pytest.mark.parametrize("text", ["---\n---\nbody\n", "---\n\n   \n---\nbody\n", "---\n# only a comment\n---\nbody\n"])
def test_empty_frontmatter_is_an_empty_mapping(text):
    parsed = parse_markdown(md(text))
    assert parsed.frontmatter == {}
    assert parsed.body == "body\n"


def test_frontmatter_may_close_with_dots_and_carry_trailing_spaces():
    parsed = parse_markdown(md("---  \ntitle: A\n...\nbody"))
    assert parsed.frontmatter == {"title": "A"}
    assert parsed.body == "body"


def test_a_dashes_line_later_in_the_body_is_not_frontmatter():
    parsed = parse_markdown(md("---\ntitle: A\n---\nintro\n---\nmore\n"))
    assert parsed.body == "intro\n---\nmore\n"


@pytest.mark.parametrize("text", ["---\ntitle: A\nbody without a closing line\n", "---", "---\n"])
def test_unclosed_frontmatter(text):
    assert parse_error(md(text)) == "frontmatter is not closed: no '---' line after the opening one"


@pytest.mark.parametrize("text, line, column, problem", [
    ("---\ntitle: ok\ndescription: a: b\n---\n", 3, 15, "mapping values are not allowed"),
    ("---\ntitle: ok\n  indented: x\n---\n", 3, 11, "mapping values are not allowed"),
    ("---\n\n\n\ntitle: ok\nbad: 'quote\n---\n", 7, 1, "unexpected end of stream"),
])
def test_malformed_yaml_names_the_line_of_the_file(text, line, column, problem):
    message = parse_error(md(text))
    assert message.startswith(f"malformed YAML frontmatter: line {line}, column {column}: ")
    assert problem in message


def test_unsafe_yaml_tags_are_refused_not_run():
    message = parse_error(md("---\na: !!python/object/apply:os.system ['echo hi']\n---\n"))
    assert message.startswith("malformed YAML frontmatter: line 2")


@pytest.mark.parametrize("text, kind", [("---\n- a\n- b\n---\n", "a list"), ("---\njust words\n---\n", "a string"),
                                        ("---\n42\n---\n", "a number")])
def test_frontmatter_must_be_a_mapping(text, kind):
    assert parse_error(md(text)) == f"frontmatter must be a mapping of fields, not {kind}"


def test_non_utf8_names_byte_offset_and_line():
    data = b"---\ntitle: A\n---\ncaf\xe9\n"
    assert parse_error(data) == "not UTF-8 text: invalid byte 0xE9 at offset 20 (line 4)"


def test_non_utf8_offset_counts_the_bom_and_crlf_lines():
    data = b"\xef\xbb\xbfone\r\ntwo\r\n\xff"
    assert parse_error(data) == "not UTF-8 text: invalid byte 0xFF at offset 13 (line 3)"


def test_bom_is_dropped():
    parsed = parse_markdown(b"\xef\xbb\xbf---\ntitle: A\n---\nbody")
    assert parsed.frontmatter == {"title": "A"}
    assert parsed.body == "body"


def test_crlf_and_cr_line_endings_are_normalised():
    parsed = parse_markdown(b"---\r\ntitle: A\r\n---\r\nline 1\r\nline 2\rline 3\r\n")
    assert parsed.frontmatter == {"title": "A"}
    assert parsed.body == "line 1\nline 2\nline 3\n"


def test_nul_bytes_mean_a_binary_file():
    assert "binary" in parse_error(b"PK\x03\x04\x00\x00 zip")


def test_file_size_limit():
    assert parse_markdown(b"a" * MAX_FILE_BYTES).body == "a" * MAX_FILE_BYTES
    too_big = b"a" * (MAX_FILE_BYTES + 1)
    assert parse_error(too_big) == f"file is larger than 1 MiB ({MAX_FILE_BYTES + 1} bytes)"


def test_frontmatter_size_limit():
    ok = "---\n" + "a: " + "x" * (MAX_FRONTMATTER_BYTES - 10) + "\n---\n"
    assert parse_markdown(md(ok)).frontmatter["a"].startswith("xxx")
    big = "---\n" + "a: " + "x" * MAX_FRONTMATTER_BYTES + "\n---\n"
    assert "frontmatter is larger than 64 KiB" in parse_error(md(big))


def test_alias_bomb_is_refused_quickly():
    lines = ["---", 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    previous = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
        previous = name
    lines.append("---")
    start = time.monotonic()
    message = parse_error(md("\n".join(lines) + "\n"))
    assert time.monotonic() - start < 1.0
    assert message == "frontmatter is too large or too deeply nested"


def test_shared_aliases_within_the_budget_are_fine():
    parsed = parse_markdown(md("---\nbase: &b [x, y]\ncopy: *b\n---\n"))
    assert parsed.frontmatter == {"base": ["x", "y"], "copy": ["x", "y"]}


@pytest.mark.parametrize("text", ["---\na: " + "[" * 25 + "]" * 25 + "\n---\n", "---\na: &a [*a]\n---\n"])
def test_deep_or_recursive_frontmatter_is_refused(text):
    assert parse_error(md(text)) == "frontmatter is too large or too deeply nested"


def test_binary_yaml_values_are_refused():
    assert "binary" in parse_error(md("---\nblob: !!binary aGVsbG8=\n---\n"))


def test_values_are_made_json_safe():
    parsed = parse_markdown(md("---\n1: one\nnan: .nan\ninf: -.inf\nset: !!set {a: null}\npairs: !!pairs [a: 1]\n"
                               "impossible: 2024-13-45\n---\n"))
    assert parsed.frontmatter == {"1": "one", "nan": "nan", "inf": "-inf", "set": ["a"], "pairs": [["a", 1]],
                                  "impossible": "2024-13-45"}


# -- ids -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, expected", [
    ("data/resources/patterns/Cell Governance.md", "Cell Governance"),
    ("notes.md", "notes"),
    ("docs/dao/toolkit/index.md", "toolkit"),
    ("index.md", "index"),
    ("docs/Index.md", "Index"),
    ("docs/v1.2 notes.md", "v1.2 notes"),
])
def test_entry_id(path, expected):
    assert entry_id(path) == expected


def test_entry_id_limit_is_64_bytes_of_utf8():
    assert entry_id("a" * 64 + ".md") == "a" * 64
    assert entry_id("é" * 32 + ".md") == "é" * 32  # 64 bytes
    assert entry_id("😀" * 16 + ".md") == "😀" * 16  # 64 bytes
    for name in ("a" * 65, "é" * 32 + "a", "😀" * 16 + "é", "é" * 33):
        with pytest.raises(ParseError, match=r"is longer than 64 bytes"):
            entry_id(f"docs/{name}.md")
    with pytest.raises(ParseError, match=r"is longer than 64 bytes"):
        entry_id("docs/" + "é" * 40 + "/index.md")


@pytest.mark.parametrize("path", [".md", "docs/.md", ""])
def test_empty_entry_id_is_an_error(path):
    with pytest.raises(ParseError):
        entry_id(path)


# -- first heading ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, expected", [
    ("intro\n\n# Cell Governance\n\n# Second\n", "Cell Governance"),
    ("## Sub\n# Main ##\n", "Main"),
    ("# C# for DAOs\n", "C# for DAOs"),
    ("```\n# not a heading\n```\n# Real\n", "Real"),
    ("~~~~\n# fenced\n~~~\n# still fenced\n~~~~\n# After\n", "After"),
    ("#hashtag\n## h2 only\n", None),
    ("```\n# unclosed fence\n", None),
    ("", None),
])
def test_first_heading(body, expected):
    assert first_heading(body) == expected


# -- links -----------------------------------------------------------------------------------------------------


def targets(body: str, path: str = "docs/group/page.md") -> list[tuple[str, str | None]]:
    return [(link.target, link.label) for link in extract_links(body, path=path)]


def test_wikilinks_of_every_form():
    body = ("[[Cell Governance]] [[Pattern One|the first pattern]] [[Page#Heading]] [[Page Two#Heading|see here]] "
            "[[Block Ref^abc123]] ![[Embedded Note]] [[ spaced ]]")
    assert targets(body) == [("Cell Governance", None), ("Pattern One", "the first pattern"), ("Page", None),
                             ("Page Two", "see here"), ("Block Ref", None), ("Embedded Note", None), ("spaced", None)]


def test_wikilink_paths_and_index_notes():
    assert targets("[[folder/sub/note]] [[docs/dao/toolkit/index]] [[other.md]]") == [
        ("note", None), ("toolkit", None), ("other", None)]


def test_wikilinks_to_attachments_and_the_same_page_are_skipped():
    body = "![[diagram.png]] [[paper.pdf]] ![[photo.JPG|300]] [[#Heading]] [[^block]] [[node.js]] [[Web 3.0]]"
    assert targets(body) == [("node.js", None), ("Web 3.0", None)]


def test_wikilink_escaped_pipe_in_a_table():
    assert targets("| a | [[Target\\|label]] |") == [("Target", "label")]


def test_markdown_links_relative_to_the_file():
    body = ("[same folder](other.md) [parent](../overview.md#intro) [space](Some%20Note.md) "
            "[angle](<../shared/With Space.md>) [titled](titled.md \"Title\") [index](sub/index.md)")
    assert targets(body, "docs/group/page.md") == [
        ("other", "same folder"), ("overview", "parent"), ("Some Note", "space"), ("With Space", "angle"),
        ("titled", "titled"), ("sub", "index")]


def test_markdown_links_that_are_not_entries_are_skipped():
    body = ("[web](https://example.org/page.md) [mail](mailto:someone@example.org) [anchor](#section) "
            "![image](diagram.png) [pdf](paper.pdf) [protocol-relative](//host/x.md) [ftp](ftp://h/x.md)")
    assert targets(body) == []


def test_links_climbing_out_of_the_vault_are_skipped():
    assert targets("[out](../../x.md) [in](../x.md) [root](/y.md)", "a/b.md") == [("x", "in"), ("y", "root")]
    assert targets("[ok](../x.md)", "a/b/c.md") == [("x", "ok")]
    assert targets("[out](../../../x.md) [in](../../x.md)", "docs/group/page.md") == [("x", "in")]


def test_links_in_code_are_ignored():
    body = ("before [[Real One]]\n```\n[[In Fence]] [x](fenced.md)\n```\n~~~python\n[[Tilde Fence]]\n~~~\n"
            "inline `[[In Code]]` and ``[x](code.md) ` still`` then [[Real Two]]\n")
    assert targets(body) == [("Real One", None), ("Real Two", None)]


def test_pathological_lines_are_scanned_quickly():
    bodies = ["".join("`" * k + "a[" for k in range(1, 1300)), "[" * 300_000, "[a](" * 100_000, "[[" + "a" * 300_000]
    start = time.monotonic()
    for body in bodies:
        assert extract_links(body, path="p.md") == []
    assert time.monotonic() - start < 3.0


def test_links_come_in_document_order_deduplicated_on_target_and_label():
    body = "[b](b.md) [[a]] and [[a]] again, [[a|A]] and [b](b.md)\n[[c]] [b again](b.md)"
    assert targets(body) == [("b", "b"), ("a", None), ("a", "A"), ("c", None), ("b", "b again")]


def test_link_raw_text_is_kept_and_truncated():
    links = extract_links("see [[Target#h|Label]] and [x](y.md)", path="p.md")
    assert links == [Link(target="Target", label="Label", raw="[[Target#h|Label]]"),
                     Link(target="y", label="x", raw="[x](y.md)")]
    long = "[" + "x" * 300 + "](y.md)"
    assert len(extract_links(long, path="p.md")[0].raw) == 200


def test_links_with_overlong_ids_are_skipped_without_raising():
    assert targets(f"[[{'é' * 40}]] [x]({'a' * 70}.md) [[ok]]") == [("ok", None)]


# -- the content types -----------------------------------------------------------------------------------------


BASE = ("title: The Title\ndescription: What it is about\ndate: 2024-03-01\npublish: true\ndraft: false\n"
        "permalink: /the-title\nauthor: [Ada, Grace]\ngroup: dao-primitives\ntags: [governance, '#cells']\n")
SPECIFIC = {
    "file": "", "reference": "", "index": "", "playbook": "", "study": "release: toolkit-v1\n", "data": "",
    "link": "url: https://example.org/resource\n",
    "tag": "aliases: [Cell]\nrelatedTerms: [DAO, Guild]\ncategory: organisation\n",
    "resource": "release: toolkit-v1\nhasPart: [part-a]\nisPartOf: [whole]\n",
    "pattern": "release: toolkit-v1\nhasPart: [a]\nisPartOf: [b]\ncontext: c\nproblem: p\nsolution: s\n"
               "relatedPatterns: [other]\n",
    "practice": "patterns: [p1]\npractitioners: [Ada]\n",
    "primitive": "category: governance\n",
    "protocol": "steps: [one, two]\n",
    "question": "status: exploring\nrelated: [q2]\nproposedBy: [Ada]\n",
    "story": "release: toolkit-v1\n",
    "article": "url: https://example.org/essay\ncurator: Ada\nharvester: Grace\n",
    "person": "aliases: [AL]\nroles: [steward]\ngroups: [dao]\nhomepage: https://ada.example\n"
              "email: ada@example.org\nimage: ada.png\n",
    "group": "slug: dao\nmembers: [Ada]\nparent: network\nhomepage: http://dao.example\n",
    "project": "slug: p\nstatus: active\nlead: [Ada]\ncontributors: [Grace]\nrepository: https://git.example/p\n"
               "homepage: https://p.example\nstartDate: 2024-01-01\nendDate: 2024-12-31T18:00:00Z\n",
    "place": "geo: 45.5,-73.6\ncontainedIn: Quebec\nregion: Saint Lawrence\n",
    "gathering": "location: Montreal\nstartDate: 2024-06-01\nendDate: 2024-06-03\norganizers: [Ada]\n"
                 "attendees: [Grace, Linus]\noutcomes: [charter]\n",
}


def test_there_are_21_content_types_and_18_union_members():
    assert len(CONTENT_TYPES) == 21 and set(SPECIFIC) == set(CONTENT_TYPES)
    assert len(UNION_TYPES) == 18 and set(CONTENT_TYPES) - set(UNION_TYPES) == {"resource", "story", "data"}
    assert set(CONTENT_STRUCTS) == set(CONTENT_TYPES)
    assert PARENT_TYPES["pattern"] == "resource" and PARENT_TYPES["study"] == "story"
    assert PARENT_TYPES["tag"] == "reference" and PARENT_TYPES["person"] == "data"
    assert set(PARENT_TYPES) == set(CONTENT_TYPES) - {"file"}


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_every_content_type_validates_a_full_frontmatter(content_type):
    text = f"---\ntype: {content_type}\n{BASE}{SPECIFIC[content_type]}---\n# Heading\n"
    parsed = parse_markdown(md(text))
    v = Ontology().resolve("docs/group/entry.md", parsed.frontmatter, fallback_title="entry")
    assert v.issues == []
    assert v.content_type == content_type
    assert (v.title, v.description, v.group, v.publish, v.draft) == (
        "The Title", "What it is about", "dao-primitives", True, False)
    assert v.date == 1709251200000 and v.fields["date"] == "2024-03-01"
    assert v.tags == ["governance", "cells"]
    assert v.fields["author"] == ["Ada", "Grace"]
    for name in parsed.frontmatter:  # every field is kept
        assert name in v.fields
    decoded = msgspec.convert(v.fields, Content)  # the union picks the struct of the type
    assert type(decoded) is CONTENT_STRUCTS[content_type]
    assert msgspec.to_builtins(decoded)["type"] == content_type
    assert msgspec.convert(v.fields, CONTENT_STRUCTS[content_type]) == decoded  # the struct accepts its own fields
    for spec in msgspec.structs.fields(decoded):
        if spec.name in parsed.frontmatter and spec.name not in ("date", "startDate", "endDate", "tags"):
            assert getattr(decoded, spec.name) == parsed.frontmatter[spec.name], spec.name


def test_type_specific_values_come_out_converted():
    text = f"---\ntype: project\n{BASE}{SPECIFIC['project']}---\n"
    v = Ontology().resolve("docs/p.md", parse_markdown(md(text)).frontmatter, fallback_title="p")
    assert v.status == "active"
    assert v.fields["startDate"] == "2024-01-01" and v.fields["endDate"] == "2024-12-31T18:00:00Z"
    decoded = msgspec.convert(v.fields, Content)
    assert (decoded.homepage, decoded.lead, decoded.status) == ("https://p.example", ["Ada"], "active")


def test_a_data_folder_gives_the_type_without_frontmatter_type():
    v = Ontology().resolve("data/people/Ada.md", {"title": "Ada", "date": "2024-01-01", "email": "ada@example.org"},
                           fallback_title="Ada")
    assert v.content_type == "person" and v.issues == []
    assert msgspec.convert(v.fields, Content).email == "ada@example.org"


# -- field by field validation ---------------------------------------------------------------------------------


def resolve(frontmatter, path="docs/x/entry.md", ontology=None):
    return (ontology or Ontology()).resolve(path, frontmatter, fallback_title="Fallback")


def test_invalid_fields_are_dropped_with_issues_and_the_entry_is_kept():
    v = resolve({"type": "person", "title": "Ada", "date": "next tuesday", "email": "not-an-email",
                 "homepage": "ftp://ada.example", "publish": "maybe", "roles": [{"a": 1}], "image": "ada.png"})
    assert v.content_type == "person"
    assert dict(v.issues) == {"date": "not a date: 'next tuesday'", "email": "not an email address: 'not-an-email'",
                              "homepage": "not an http(s) URL: 'ftp://ada.example'", "publish": "not true or false: 'maybe'",
                              "roles": "not a list of strings: [{'a': 1}]"}
    assert v.fields == {"type": "person", "title": "Ada", "image": "ada.png"}
    assert (v.date, v.publish) == (None, False)
    assert type(msgspec.convert(v.fields, Content)).__name__ == "PersonContent"


def test_enum_fields():
    v = resolve({"type": "question", "title": "Q", "date": "2024-01-01", "status": "Open"})
    assert v.status == "open" and v.issues == []
    v = resolve({"type": "question", "title": "Q", "date": "2024-01-01", "status": "done"})
    assert v.status is None and v.issues == [("status", "not one of open, exploring, resolved: 'done'")]
    v = resolve({"type": "project", "title": "P", "date": "2024-01-01", "status": "paused"})
    assert v.status == "paused"


def test_status_group_and_release_of_other_types_are_kept_as_given():
    v = resolve({"type": "article", "title": "A", "date": "2024-01-01", "status": "draft-ish", "group": 2024,
                 "release": 2.1})
    assert (v.status, v.group, v.release) == ("draft-ish", "2024", "2.1")
    assert v.fields["status"] == "draft-ish" and v.issues == []
    v = resolve({"type": "person", "title": "P", "date": "2024-01-01", "release": "v2"})
    assert v.release == "v2" and v.fields["release"] == "v2"


def test_missing_or_empty_title_uses_the_fallback():
    for title in (None, "", "   "):
        frontmatter = {"date": "2024-01-01"} if title is None else {"title": title, "date": "2024-01-01"}
        v = resolve(frontmatter)
        assert v.title == "Fallback" and v.fields["title"] == "Fallback"
        assert v.issues == [("title", "missing: used 'Fallback'")]
    v = resolve({"title": ["a", "list"], "date": "2024-01-01"})
    assert v.title == "Fallback" and v.issues == [("title", "not a string: ['a', 'list']: used 'Fallback'")]
    assert resolve({"title": 1984, "date": "2024-01-01"}).title == "1984"


def test_missing_date_is_reported_and_the_entry_kept():
    v = resolve({"title": "T"})
    assert v.issues == [("date", "missing")] and v.date is None and v.content_type == "file"


def test_a_link_without_url_is_kept_and_reported():
    v = resolve({"title": "L", "date": "2024-01-01"}, path="data/links/l.md")
    assert v.content_type == "link" and v.issues == [("url", "missing")]
    assert type(msgspec.convert(v.fields, Content)).__name__ == "LinkContent"


@pytest.mark.parametrize("value, iso, ms", [
    (datetime.date(2024, 3, 1), "2024-03-01", 1709251200000),
    (datetime.datetime(2024, 3, 1, 12, 0), "2024-03-01T12:00:00Z", 1709294400000),
    (datetime.datetime(2024, 3, 1, 12, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
     "2024-03-01T10:00:00Z", 1709287200000),
    ("2024-03-01", "2024-03-01", 1709251200000),
    ("2024-03-01T12:00:00", "2024-03-01T12:00:00Z", 1709294400000),
    ("2024-03-01T12:00:00.250+00:00", "2024-03-01T12:00:00.250Z", 1709294400250),
    ("2024-03-01T12:00:00Z", "2024-03-01T12:00:00Z", 1709294400000),
    (1709294400000, "2024-03-01T12:00:00Z", 1709294400000),
])
def test_dates(value, iso, ms):
    v = resolve({"title": "T", "date": value})
    assert v.fields["date"] == iso and v.date == ms and v.issues == []


@pytest.mark.parametrize("value", ["next tuesday", "2024-13-45", "", True, 1.5, [2024], 10**20])
def test_bad_dates_are_dropped(value):
    v = resolve({"title": "T", "date": value})
    assert v.date is None and "date" not in v.fields
    assert v.issues[0][0] == "date" and v.issues[0][1].startswith("not a date")


def test_an_impossible_yaml_date_reaches_the_user_as_a_field_issue():
    parsed = parse_markdown(md("---\ntitle: T\ndate: 2024-13-45\n---\n"))
    assert resolve(parsed.frontmatter).issues == [("date", "not a date: '2024-13-45'")]


def test_tags_and_lists_accept_loose_forms():
    assert resolve({"title": "T", "tags": "a, b c, #d"}).tags == ["a", "b c", "d"]
    assert resolve({"title": "T", "tags": "#Alpha #beta"}).tags == ["Alpha", "beta"]
    assert resolve({"title": "T", "tags": ["#x", "x", 2024, None]}).tags == ["x", "2024"]
    v = resolve({"title": "T", "author": "Ada Lovelace"})
    assert v.fields["author"] == ["Ada Lovelace"]
    v = resolve({"title": "T", "publish": "TRUE", "draft": "false"})
    assert (v.publish, v.draft) == (True, False)


def test_unknown_fields_are_kept_json_safe():
    v = resolve({"title": "T", "date": "2024-01-01", "cssclass": "wide", "when": datetime.date(2024, 1, 2),
                 "nested": {"at": datetime.datetime(2024, 1, 2, 3, 4, 5)}})
    assert v.fields["cssclass"] == "wide" and v.fields["when"] == "2024-01-02"
    assert v.fields["nested"] == {"at": "2024-01-02T03:04:05Z"}
    assert v.issues == []


# -- typing: path map, aliases, unknown types ------------------------------------------------------------------


def test_path_map_matches_the_longest_prefix_on_whole_segments():
    ont = Ontology.from_json({"path_types": {"data": "data", "data/links": "link", "data/links/people": "person"}})
    assert ont.path_type("data/links/x.md") == "link"
    assert ont.path_type("data/links/people/ada.md") == "person"
    assert ont.path_type("data/linksx/y.md") == "data"
    assert ont.path_type("datax/y.md") is None
    assert ont.path_type("docs/data/links/x.md") is None
    assert Ontology().path_type("data/resources/patterns/sub/p.md") == "pattern"
    assert Ontology().path_type("docs/anything.md") is None


def test_folder_type_wins_over_a_disagreeing_frontmatter_type():
    v = resolve({"type": "practice", "title": "P", "date": "2024-01-01"}, path="data/resources/patterns/p.md")
    assert v.content_type == "pattern"
    assert v.issues == [("type", "the folder says 'pattern'; frontmatter type 'practice' ignored")]
    assert v.fields["type"] == "pattern"
    for agreeing in ("pattern", "Resource", "file"):  # the same type, or a parent of it
        assert resolve({"type": agreeing, "title": "P", "date": "2024-01-01"},
                       path="data/resources/patterns/p.md").issues == []


def test_docs_take_the_frontmatter_type():
    assert resolve({"type": "Pattern", "title": "P", "date": "2024-01-01"}, path="docs/g/p.md").content_type == "pattern"
    assert resolve({"title": "P", "date": "2024-01-01"}, path="docs/g/p.md").content_type == "file"


def test_default_aliases_are_case_insensitive():
    assert DEFAULT_TYPE_ALIASES == {"concept": "tag", "guide": "article"}
    for name in ("concept", "Concept", " CONCEPT "):
        v = resolve({"type": name, "title": "T", "date": "2024-01-01"})
        assert v.content_type == "tag" and v.issues == []
    assert resolve({"type": "Guide", "title": "T", "date": "2024-01-01"}).content_type == "article"


def test_custom_alias_and_removing_a_default():
    ont = Ontology.from_json({"type_aliases": {"Essay": "article", "guide": None}})
    assert resolve({"type": "essay", "title": "T", "date": "2024-01-01"}, ontology=ont).content_type == "article"
    assert resolve({"type": "concept", "title": "T", "date": "2024-01-01"}, ontology=ont).content_type == "tag"
    v = resolve({"type": "guide", "title": "T", "date": "2024-01-01"}, ontology=ont)
    assert v.content_type == "file"
    assert v.issues == [("type", "unknown type 'guide': kept as file (add it to ontology.type_aliases)")]


@pytest.mark.parametrize("value, shown", [("recipe", "'recipe'"), (["pattern"], "['pattern']"), (7, "7")])
def test_unknown_type_is_kept_as_file(value, shown):
    v = resolve({"type": value, "title": "T", "date": "2024-01-01", "ingredients": ["x"]})
    assert v.content_type == "file"
    assert v.issues == [("type", f"unknown type {shown}: kept as file (add it to ontology.type_aliases)")]
    assert v.fields["ingredients"] == ["x"]


# -- ontology settings -----------------------------------------------------------------------------------------


def test_defaults():
    for data in (None, {}):
        ont = Ontology.from_json(data)
        assert dict(ont.path_types) == DEFAULT_PATH_TYPES and "docs" not in ont.path_types
        assert dict(ont.type_aliases) == DEFAULT_TYPE_ALIASES
        assert ont.require_publish is True and ont.skip_drafts is True
        assert ont == Ontology()


def test_given_keys_replace_defaults_but_aliases_merge():
    ont = Ontology.from_json({"path_types": {"kb/terms/": "tag"}, "type_aliases": {"Essay": "article"},
                              "require_publish": False})
    assert dict(ont.path_types) == {"kb/terms": "tag"}
    assert dict(ont.type_aliases) == {"concept": "tag", "guide": "article", "essay": "article"}
    assert ont.require_publish is False and ont.skip_drafts is True


@pytest.mark.parametrize("data, field", [
    ({"colour": "blue"}, "ontology.colour"),
    ({"path_types": ["data"]}, "ontology.path_types"),
    ({"path_types": {"data/x": "recipe"}}, "ontology.path_types"),
    ({"path_types": {"/data/x": "tag"}}, "ontology.path_types"),
    ({"path_types": {"data/../x": "tag"}}, "ontology.path_types"),
    ({"path_types": {"": "tag"}}, "ontology.path_types"),
    ({"path_types": {"a" * 201: "tag"}}, "ontology.path_types"),
    ({"path_types": {f"f{i}": "tag" for i in range(101)}}, "ontology.path_types"),
    ({"type_aliases": "concept=tag"}, "ontology.type_aliases"),
    ({"type_aliases": {"essay": "essays"}}, "ontology.type_aliases"),
    ({"type_aliases": {"": "tag"}}, "ontology.type_aliases"),
    ({"type_aliases": {"x" * 65: "tag"}}, "ontology.type_aliases"),
    ({"type_aliases": {f"a{i}": "tag" for i in range(101)}}, "ontology.type_aliases"),
    ({"require_publish": "yes"}, "ontology.require_publish"),
    ({"skip_drafts": 1}, "ontology.skip_drafts"),
])
def test_bad_settings_are_refused(data, field):
    with pytest.raises(InvalidInput) as info:
        Ontology.from_json(data)
    assert info.value.details == {"field": field}


def test_limits_are_inclusive():
    assert len(Ontology.from_json({"path_types": {f"f{i}": "tag" for i in range(100)}}).path_types) == 100
    assert Ontology.from_json({"type_aliases": {"x" * 64: "tag"}}).type_aliases["x" * 64] == "tag"


def test_to_json_round_trips_and_ignores_content_types():
    ont = Ontology.from_json({"path_types": {"kb/terms": "tag", "kb/people": "person"},
                              "type_aliases": {"guide": None, "Essay": "article"}, "skip_drafts": False})
    out = ont.to_json()
    assert out["content_types"] == list(CONTENT_TYPES)
    assert out["path_types"] == {"kb/terms": "tag", "kb/people": "person"}
    assert out["require_publish"] is True and out["skip_drafts"] is False
    assert Ontology.from_json(out) == ont
    assert Ontology.from_json(Ontology().to_json()) == Ontology()
    assert resolve({"type": "guide", "title": "T"}, ontology=Ontology.from_json(out)).content_type == "file"


def test_fingerprint_changes_when_a_setting_changes():
    base = Ontology().fingerprint()
    assert len(base) == 64 and base == Ontology.from_json({}).fingerprint()
    assert Ontology.from_json(Ontology().to_json()).fingerprint() == base
    changed = [
        {"path_types": {"data/concepts": "tag"}},
        {"type_aliases": {"essay": "article"}},
        {"type_aliases": {"guide": None}},
        {"require_publish": False},
        {"skip_drafts": False},
    ]
    prints = {Ontology.from_json(c).fingerprint() for c in changed}
    assert base not in prints and len(prints) == len(changed)
