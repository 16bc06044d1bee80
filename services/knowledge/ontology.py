"""The seed's content model (knowledge-server spec §3): 21 content types, their schemas, and a knowledge base's ontology.

The schemas of §3.6 are msgspec Structs (``FileFields`` and its subclasses, camelCase field names as in the seed,
plus ``tags`` on the base: vaults use it everywhere); ``Content`` is the discriminated union of §3.7 (tag field
``type``), with a member for each of the 21 content types (``resource``, ``story`` and ``data`` validate with their
parent schema).

An :class:`Ontology` is one knowledge base's settings: which folders imply which type (the seed's PATH_TYPE_MAP),
aliases of frontmatter type names, and whether unpublished files and drafts are skipped. :meth:`Ontology.resolve`
types one file and validates its frontmatter field by field: a field that does not validate is dropped and
reported, and the entry is kept with what is valid (a vault is written by people; one typo should not hide a page).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from services.errors import InvalidInput

__all__ = [
    "CONTENT_TYPES", "UNION_TYPES", "PARENT_TYPES", "DEFAULT_PATH_TYPES", "DEFAULT_TYPE_ALIASES",
    "MAX_PATH_TYPES", "MAX_TYPE_ALIASES",
    "Title", "Url", "Email", "IsoDate",
    "FileFields", "ReferenceFields", "ResourceFields", "StoryFields", "DataFields", "LinkFields", "TagFields",
    "PatternFields", "PracticeFields", "PrimitiveFields", "ProtocolFields", "PlaybookFields", "QuestionFields",
    "StudyFields", "ArticleFields", "PersonFields", "GroupFields", "ProjectFields", "PlaceFields", "GatheringFields",
    "FileContent", "ReferenceContent", "IndexContent", "LinkContent", "TagContent", "ResourceContent",
    "PatternContent", "PracticeContent", "PrimitiveContent", "ProtocolContent", "PlaybookContent",
    "QuestionContent", "StoryContent", "StudyContent", "ArticleContent", "DataContent", "PersonContent",
    "GroupContent", "ProjectContent", "PlaceContent", "GatheringContent",
    "Content", "CONTENT_STRUCTS", "Validated", "Ontology",
]

# -- the content types (§3.3, §3.4, §3.5) ----------------------------------------------------------------------

CONTENT_TYPES: tuple[str, ...] = (
    "file",
    "reference", "index", "link", "tag",
    "resource", "pattern", "practice", "primitive", "protocol", "playbook",
    "question",
    "story", "study", "article",
    "data", "person", "group", "project", "place", "gathering",
)
#: The members of the seed's discriminated union (§3.7): every type but the parents resource, story and data.
UNION_TYPES: tuple[str, ...] = tuple(t for t in CONTENT_TYPES if t not in ("resource", "story", "data"))
#: Each type's parent in the hierarchy of §3.2 ('file', the root, has none).
PARENT_TYPES: dict[str, str] = {
    "reference": "file", "resource": "file", "question": "file", "story": "file", "data": "file",
    "index": "reference", "link": "reference", "tag": "reference",
    "pattern": "resource", "practice": "resource", "primitive": "resource", "protocol": "resource", "playbook": "resource",
    "study": "story", "article": "story",
    "person": "data", "group": "data", "project": "data", "place": "data", "gathering": "data",
}
#: The seed's PATH_TYPE_MAP without 'docs' -> 'file': a file under docs/ takes its frontmatter type.
DEFAULT_PATH_TYPES: dict[str, str] = {
    "data/concepts": "tag",
    "data/links": "link",
    "data/resources/patterns": "pattern",
    "data/resources/practices": "practice",
    "data/resources/primitives": "primitive",
    "data/resources/protocols": "protocol",
    "data/resources/playbooks": "playbook",
    "data/stories/studies": "study",
    "data/stories/articles": "article",
    "data/questions": "question",
    "data/people": "person",
    "data/groups": "group",
    "data/projects": "project",
    "data/places": "place",
    "data/gatherings": "gathering",
}
#: The seed: 'guide' is deprecated (use article); concepts are tags.
DEFAULT_TYPE_ALIASES: dict[str, str] = {"concept": "tag", "guide": "article"}
MAX_PATH_TYPES = 100
MAX_TYPE_ALIASES = 100
MAX_PREFIX = 200
MAX_ALIAS = 64

# -- the schemas (§3.6) ----------------------------------------------------------------------------------------

_URL_PATTERN = r"^(?i:https?)://[^\s/?#]+(?:[/?#]\S*)?$"
_EMAIL_PATTERN = r"^[^@\s]+@[^@\s]+\.[^@\s]+$"
_ISO_PATTERN = r"^\d{4}-\d{2}-\d{2}(?:T\d{2}:\d{2}:\d{2}(?:\.\d{3})?Z)?$"

Title = Annotated[str, msgspec.Meta(min_length=1)]
Url = Annotated[str, msgspec.Meta(pattern=_URL_PATTERN)]
Email = Annotated[str, msgspec.Meta(pattern=_EMAIL_PATTERN)]
#: A date as validated: ``YYYY-MM-DD``, or a UTC date-time ``YYYY-MM-DDTHH:MM:SS[.mmm]Z``.
IsoDate = Annotated[str, msgspec.Meta(pattern=_ISO_PATTERN)]


class FileFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """FileSchema, the base of all types (its ``type`` is the union's tag). ``date`` is required by the seed; an
    entry without one is kept (and reported), so it is optional here. ``tags`` is ours."""

    title: Title
    description: str | None = None
    date: IsoDate | None = None
    publish: bool = False
    draft: bool = False
    permalink: str | None = None
    author: list[str] | None = None
    group: str | None = None
    tags: list[str] = msgspec.field(default_factory=list)


class ReferenceFields(FileFields, kw_only=True):
    """ReferenceSchema = FileSchema."""


class ResourceFields(FileFields, kw_only=True):
    release: str | None = None
    hasPart: list[str] | None = None
    isPartOf: list[str] | None = None


class StoryFields(FileFields, kw_only=True):
    release: str | None = None


class DataFields(FileFields, kw_only=True):
    """DataSchema = FileSchema."""


class LinkFields(ReferenceFields, kw_only=True):
    """The seed requires ``url``; a link without a valid one is kept (and reported), so it is optional here."""

    url: Url | None = None


class TagFields(ReferenceFields, kw_only=True):
    aliases: list[str] | None = None
    relatedTerms: list[str] | None = None
    category: str | None = None


class PatternFields(ResourceFields, kw_only=True):
    context: str | None = None
    problem: str | None = None
    solution: str | None = None
    relatedPatterns: list[str] | None = None


class PracticeFields(ResourceFields, kw_only=True):
    patterns: list[str] | None = None
    practitioners: list[str] | None = None


class PrimitiveFields(ResourceFields, kw_only=True):
    category: str | None = None


class ProtocolFields(ResourceFields, kw_only=True):
    steps: list[str] | None = None


class PlaybookFields(ResourceFields, kw_only=True):
    """PlaybookSchema = ResourceSchema."""


class QuestionFields(FileFields, kw_only=True):
    status: Literal["open", "exploring", "resolved"] | None = None
    related: list[str] | None = None
    proposedBy: list[str] | None = None


class StudyFields(StoryFields, kw_only=True):
    """StudySchema = StorySchema."""


class ArticleFields(StoryFields, kw_only=True):
    url: Url | None = None
    curator: str | None = None
    harvester: str | None = None


class PersonFields(DataFields, kw_only=True):
    aliases: list[str] | None = None
    roles: list[str] | None = None
    groups: list[str] | None = None
    homepage: Url | None = None
    email: Email | None = None
    image: str | None = None


class GroupFields(DataFields, kw_only=True):
    slug: str | None = None
    members: list[str] | None = None
    parent: str | None = None
    homepage: Url | None = None


class ProjectFields(DataFields, kw_only=True):
    slug: str | None = None
    status: Literal["active", "completed", "paused", "archived"] | None = None
    lead: list[str] | None = None
    contributors: list[str] | None = None
    repository: str | None = None
    homepage: Url | None = None
    startDate: IsoDate | None = None
    endDate: IsoDate | None = None


class PlaceFields(DataFields, kw_only=True):
    geo: str | None = None
    containedIn: str | None = None
    region: str | None = None


class GatheringFields(DataFields, kw_only=True):
    location: str | None = None
    startDate: IsoDate | None = None
    endDate: IsoDate | None = None
    organizers: list[str] | None = None
    attendees: list[str] | None = None
    outcomes: list[str] | None = None


# -- the discriminated union (§3.7, plus the three parents) ----------------------------------------------------


class FileContent(FileFields, tag_field="type", tag="file"):
    pass


class ReferenceContent(ReferenceFields, tag_field="type", tag="reference"):
    pass


class IndexContent(ReferenceFields, tag_field="type", tag="index"):
    pass


class LinkContent(LinkFields, tag_field="type", tag="link"):
    pass


class TagContent(TagFields, tag_field="type", tag="tag"):
    pass


class ResourceContent(ResourceFields, tag_field="type", tag="resource"):
    pass


class PatternContent(PatternFields, tag_field="type", tag="pattern"):
    pass


class PracticeContent(PracticeFields, tag_field="type", tag="practice"):
    pass


class PrimitiveContent(PrimitiveFields, tag_field="type", tag="primitive"):
    pass


class ProtocolContent(ProtocolFields, tag_field="type", tag="protocol"):
    pass


class PlaybookContent(PlaybookFields, tag_field="type", tag="playbook"):
    pass


class QuestionContent(QuestionFields, tag_field="type", tag="question"):
    pass


class StoryContent(StoryFields, tag_field="type", tag="story"):
    pass


class StudyContent(StudyFields, tag_field="type", tag="study"):
    pass


class ArticleContent(ArticleFields, tag_field="type", tag="article"):
    pass


class DataContent(DataFields, tag_field="type", tag="data"):
    pass


class PersonContent(PersonFields, tag_field="type", tag="person"):
    pass


class GroupContent(GroupFields, tag_field="type", tag="group"):
    pass


class ProjectContent(ProjectFields, tag_field="type", tag="project"):
    pass


class PlaceContent(PlaceFields, tag_field="type", tag="place"):
    pass


class GatheringContent(GatheringFields, tag_field="type", tag="gathering"):
    pass


Content = Union[
    FileContent, ReferenceContent, IndexContent, LinkContent, TagContent, ResourceContent, PatternContent,
    PracticeContent, PrimitiveContent, ProtocolContent, PlaybookContent, QuestionContent, StoryContent, StudyContent,
    ArticleContent, DataContent, PersonContent, GroupContent, ProjectContent, PlaceContent, GatheringContent,
]
#: Content type -> its member of ``Content``.
CONTENT_STRUCTS: dict[str, type[FileFields]] = {
    msgspec.inspect.type_info(s).tag: s for s in Content.__args__  # type: ignore[attr-defined]
}

# -- coercion of one field -------------------------------------------------------------------------------------


class _Invalid(Exception):
    """A field that does not validate: str(exc) is the reason."""


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_DATE_ONLY = re.compile(r"\d{4}-\d{2}-\d{2}\Z")


def _shown(value: Any) -> str:
    text = repr(_json_safe(value))
    return text if len(text) <= 80 else text[:79] + "…"


def _utc(dt: datetime.datetime) -> datetime.datetime:
    return dt.replace(tzinfo=datetime.timezone.utc) if dt.tzinfo is None else dt.astimezone(datetime.timezone.utc)


def _iso_datetime(dt: datetime.datetime) -> str:
    dt = _utc(dt)
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{dt.microsecond // 1000:03d}Z" if dt.microsecond else text + "Z"


def _parse_date(value: Any) -> datetime.date | datetime.datetime:
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return _EPOCH + datetime.timedelta(milliseconds=value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        if _DATE_ONLY.match(text):
            return datetime.date.fromisoformat(text)
        return datetime.datetime.fromisoformat(text)
    raise ValueError(value)


def _as_date(value: Any) -> str:
    try:
        parsed = _parse_date(value)
        if isinstance(parsed, datetime.datetime):
            return _iso_datetime(parsed)
        return parsed.isoformat()
    except (ValueError, OverflowError, TypeError):
        raise _Invalid(f"not a date: {_shown(value)}") from None


def _epoch_ms(iso: str) -> int:
    if _DATE_ONLY.match(iso):
        day = datetime.date.fromisoformat(iso)
        dt = datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc)
    else:
        dt = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return (dt - _EPOCH) // datetime.timedelta(milliseconds=1)


def _scalar_str(value: Any) -> str | None:
    """A string, a number or a date as a string; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return str(value)
    if isinstance(value, datetime.datetime):
        return _iso_datetime(value)
    if isinstance(value, datetime.date):
        return value.isoformat()
    return None


def _as_str(value: Any) -> str:
    text = _scalar_str(value)
    if text is None:
        raise _Invalid(f"not a string: {_shown(value)}")
    return text


def _split_tags(text: str) -> list[str]:
    return text.split(",") if "," in text else text.split()


def _as_list(value: Any, *, tags: bool = False) -> list[str]:
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for item in items:
        if item is None:
            continue
        text = _scalar_str(item)
        if text is None:
            raise _Invalid(f"not a list of strings: {_shown(value)}")
        if tags:
            out.extend(_clean_tags(_split_tags(text) if not isinstance(value, list) else [text]))
        else:
            out.append(text)
    return list(dict.fromkeys(out)) if tags else out


def _clean_tags(tags: list[str]) -> list[str]:
    return [t for t in (raw.strip().lstrip("#").strip() for raw in tags) if t]


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _Invalid(f"not true or false: {_shown(value)}")


def _as_choice(value: Any, choices: tuple[str, ...]) -> str:
    text = _scalar_str(value)
    for choice in choices:
        if text is not None and text.strip().lower() == choice:
            return choice
    raise _Invalid(f"not one of {', '.join(choices)}: {_shown(value)}")


def _as_pattern(value: Any, pattern: str, what: str) -> str:
    text = _scalar_str(value)
    if text is None or not re.search(pattern, text.strip()):
        raise _Invalid(f"not {what}: {_shown(value)}")
    return text.strip()


def _literal_values(annotation: Any) -> tuple[str, ...]:
    """The choices of a ``Literal[...] | None`` annotation, in their written order."""
    for arg in (annotation, *get_args(annotation)):
        if get_origin(arg) is Literal:
            return get_args(arg)
    return ()


def _coercer(annotation: Any, name: str) -> Any:
    """A function value -> valid value (raising _Invalid) for a field annotated ``annotation``."""
    info = msgspec.inspect.type_info(annotation)
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    if isinstance(info, msgspec.inspect.ListType):
        return lambda v: _as_list(v, tags=name == "tags")
    if isinstance(info, msgspec.inspect.BoolType):
        return _as_bool
    if isinstance(info, msgspec.inspect.LiteralType):
        return lambda v: _as_choice(v, _literal_values(annotation))
    pattern = getattr(info, "pattern", None)
    if pattern == _ISO_PATTERN:
        return _as_date
    if pattern == _URL_PATTERN:
        return lambda v: _as_pattern(v, _URL_PATTERN, "an http(s) URL")
    if pattern == _EMAIL_PATTERN:
        return lambda v: _as_pattern(v, _EMAIL_PATTERN, "an email address")
    return _as_str


@lru_cache(maxsize=None)
def _fields_of(struct: type[msgspec.Struct]) -> dict[str, tuple[Any, Any]]:
    """Field name -> (annotation, coercer) of one content struct."""
    return {f.name: (f.type, _coercer(f.type, f.name)) for f in msgspec.structs.fields(struct)}


def _check(value: Any, annotation: Any, coerce: Any) -> Any:
    out = coerce(value)
    try:
        return msgspec.convert(out, annotation)
    except msgspec.ValidationError as exc:
        raise _Invalid(f"{exc}: {_shown(value)}") from None


def _json_safe(value: Any) -> Any:
    """Frontmatter made JSON-safe: dates as ISO strings, keys as strings, sets and tuples as lists."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return _scalar_str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_safe(v) for v in value]
    return str(value)


# -- the result of resolving one file --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Validated:
    content_type: str
    #: Every frontmatter field that validated (dates as ISO strings), ``type`` (the content type) and ``title``,
    #: plus the fields the type's schema does not know, as given (JSON-safe).
    fields: dict[str, Any]
    #: (field, reason) for each field dropped by validation or fixed up, and for type problems.
    issues: list[tuple[str, str]]
    title: str
    description: str | None
    date: int | None  # epoch ms of `date`
    group: str | None
    release: str | None  # the frontmatter `release` (the caller fills it from the release folder when None)
    status: str | None
    tags: list[str]
    publish: bool
    draft: bool


# -- the ontology of a knowledge base --------------------------------------------------------------------------

_KEYS = ("path_types", "type_aliases", "require_publish", "skip_drafts")


def _bad(key: str, message: str) -> InvalidInput:
    return InvalidInput(f"ontology.{key}: {message}", details={"field": f"ontology.{key}"})


def _check_mapping(value: Any, key: str, limit: int) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise _bad(key, "must be an object")
    if len(value) > limit:
        raise _bad(key, f"at most {limit} entries")
    return value


def _check_type(value: Any, key: str, what: str) -> str:
    if not isinstance(value, str) or value not in CONTENT_TYPES:
        raise _bad(key, f"{what}: {value!r} is not a content type (one of {', '.join(CONTENT_TYPES)})")
    return value


def _check_prefix(prefix: Any) -> str:
    if not isinstance(prefix, str):
        raise _bad("path_types", f"{prefix!r} is not a folder path")
    clean = prefix.rstrip("/")
    segments = clean.split("/")
    if not 1 <= len(clean) <= MAX_PREFIX or clean.startswith("/") or any(s in ("", ".", "..") for s in segments):
        raise _bad("path_types", f"{prefix!r}: a relative folder path of 1-{MAX_PREFIX} characters, without '..'")
    return clean


def _path_types(value: Any) -> dict[str, str]:
    mapping = _check_mapping(value, "path_types", MAX_PATH_TYPES)
    return {_check_prefix(p): _check_type(t, "path_types", f"folder {p!r}") for p, t in mapping.items()}


def _type_aliases(value: Any) -> dict[str, str]:
    mapping = _check_mapping(value, "type_aliases", MAX_TYPE_ALIASES)
    out = dict(DEFAULT_TYPE_ALIASES)
    for name, target in mapping.items():
        if not isinstance(name, str) or not 1 <= len(name.strip()) <= MAX_ALIAS:
            raise _bad("type_aliases", f"{name!r}: an alias is a type name of 1-{MAX_ALIAS} characters")
        key = name.strip().lower()
        if target is None:
            out.pop(key, None)
        else:
            out[key] = _check_type(target, "type_aliases", f"alias {name!r}")
    return out


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, "must be true or false")
    return value


def _under(path: str, prefix: str) -> bool:
    return path.startswith(prefix + "/")


def _ancestors(content_type: str) -> set[str]:
    out = set()
    while content_type in PARENT_TYPES:
        content_type = PARENT_TYPES[content_type]
        out.add(content_type)
    return out


def _loose_str(value: Any) -> str | None:
    text = _scalar_str(value)
    return text if text is not None and text.strip() else None


@dataclass(frozen=True)
class Ontology:
    path_types: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_PATH_TYPES))
    type_aliases: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TYPE_ALIASES))
    require_publish: bool = True  # the seed skips a file unless `publish: true`
    skip_drafts: bool = True  # the seed skips `draft: true`

    def __post_init__(self) -> None:
        object.__setattr__(self, "path_types", MappingProxyType(dict(self.path_types)))
        object.__setattr__(self, "type_aliases", MappingProxyType({k.lower(): v for k, v in self.type_aliases.items()}))

    # -- settings --

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Ontology:
        """Settings from JSON (a request or the stored ones): given keys replace the defaults, but ``type_aliases``
        is merged over the default aliases (an alias mapped to null removes one)."""
        if not data:
            return cls()
        if not isinstance(data, Mapping):
            raise InvalidInput("ontology must be an object", details={"field": "ontology"})
        for key in data:
            if key not in _KEYS and key != "content_types":
                raise _bad(str(key), f"unknown setting (known: {', '.join(_KEYS)})")
        return cls(
            path_types=_path_types(data["path_types"]) if "path_types" in data else dict(DEFAULT_PATH_TYPES),
            type_aliases=_type_aliases(data["type_aliases"]) if "type_aliases" in data else dict(DEFAULT_TYPE_ALIASES),
            require_publish=_flag(data.get("require_publish", True), "require_publish"),
            skip_drafts=_flag(data.get("skip_drafts", True), "skip_drafts"),
        )

    def to_json(self) -> dict[str, Any]:
        """The settings as JSON; a default alias that was removed is shown as null (so from_json(to_json()) is the same)."""
        aliases: dict[str, str | None] = dict(self.type_aliases)
        aliases.update({name: None for name in DEFAULT_TYPE_ALIASES if name not in self.type_aliases})
        return {
            "path_types": dict(self.path_types),
            "type_aliases": aliases,
            "require_publish": self.require_publish,
            "skip_drafts": self.skip_drafts,
            "content_types": list(CONTENT_TYPES),
        }

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical JSON of the four settings: a change means entries must be typed again."""
        settings = {"path_types": dict(self.path_types), "type_aliases": dict(self.type_aliases),
                    "require_publish": self.require_publish, "skip_drafts": self.skip_drafts}
        canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    # -- typing a file --

    def path_type(self, path: str) -> str | None:
        """The type of the longest folder prefix holding ``path`` (whole segments), or None."""
        path = path.lstrip("/")
        best = max((p for p in self.path_types if _under(path, p)), key=len, default=None)
        return self.path_types[best] if best is not None else None

    def _frontmatter_type(self, raw: Any) -> str | None:
        if not isinstance(raw, str):
            return None
        name = raw.strip().lower()
        name = self.type_aliases.get(name, name)
        return name if name in CONTENT_TYPES else None

    def _content_type(self, path: str, raw: Any, issues: list[tuple[str, str]]) -> str:
        from_path = self.path_type(path)
        from_front = self._frontmatter_type(raw) if raw is not None else None
        if from_path is not None:
            if raw is not None and from_front != from_path and from_front not in _ancestors(from_path):
                issues.append(("type", f"the folder says '{from_path}'; frontmatter type {_shown(raw)} ignored"))
            return from_path
        if raw is not None and from_front is None:
            issues.append(("type", f"unknown type {_shown(raw)}: kept as file (add it to ontology.type_aliases)"))
        return from_front or "file"

    def resolve(self, path: str, frontmatter: Mapping[str, Any], *, fallback_title: str) -> Validated:
        """Type the file at ``path`` and validate its frontmatter field by field (see the module's docstring)."""
        issues: list[tuple[str, str]] = []
        content_type = self._content_type(path, frontmatter.get("type"), issues)
        known = _fields_of(CONTENT_STRUCTS[content_type])
        valid: dict[str, Any] = {}
        fields: dict[str, Any] = {"type": content_type}
        for key, value in frontmatter.items():
            name = str(key)
            if name == "type":
                continue
            if name not in known:
                fields[name] = _json_safe(value)
            elif value is not None and not (name == "title" and isinstance(value, str) and not value.strip()):
                try:
                    valid[name] = fields[name] = _check(value, *known[name])
                except _Invalid as exc:
                    issues.append((name, str(exc)))
        title = _title(valid, issues, fallback_title)
        fields["title"] = valid["title"] = title
        for name in _REQUIRED.get(content_type, ("date",)):
            if name not in valid and not any(f == name for f, _ in issues):
                issues.append((name, "missing"))
        msgspec.convert({"type": content_type, **valid}, Content)  # the union accepts what validated (always)
        return _validated(content_type, fields, issues, valid, frontmatter, known)


#: The seed's required fields besides title (``date`` for every type, ``url`` for a link): reported when missing.
_REQUIRED = {"link": ("date", "url")}


def _title(valid: dict[str, Any], issues: list[tuple[str, str]], fallback: str) -> str:
    if "title" in valid:
        return str(valid["title"]).strip()
    fallback = fallback.strip() or "untitled"
    for i, (name, reason) in enumerate(issues):
        if name == "title":
            issues[i] = (name, f"{reason}: used '{fallback}'")
            return fallback
    issues.append(("title", f"missing: used '{fallback}'"))
    return fallback


def _validated(content_type: str, fields: dict[str, Any], issues: list[tuple[str, str]], valid: dict[str, Any],
               frontmatter: Mapping[str, Any], known: Mapping[str, Any]) -> Validated:
    def loose(name: str) -> str | None:
        return valid.get(name) if name in known else _loose_str(frontmatter.get(name))

    return Validated(
        content_type=content_type, fields=fields, issues=issues, title=valid["title"],
        description=valid.get("description"), date=_epoch_ms(valid["date"]) if "date" in valid else None,
        group=loose("group"), release=loose("release"), status=loose("status"), tags=list(valid.get("tags", [])),
        publish=bool(valid.get("publish", False)), draft=bool(valid.get("draft", False)),
    )
