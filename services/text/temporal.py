"""Time values of conversations: parsing the times callers give, and the simple relative dates of a query.

``parse_time`` accepts what ``created_at`` / ``ts`` (append) and ``from`` / ``to`` / ``reference_time`` (search)
take: an integer of epoch **milliseconds**, or an ISO-8601 string (``2023-05-08``, ``2023-05-08T14:30``,
``2023-05-08T14:30:00Z``, ``...+02:00``; no offset means UTC; a date alone is its midnight UTC). An integer
below 1e11 (before 1973-03-03 in milliseconds) is refused: it is almost always epoch *seconds*, and storing it
as milliseconds would silently date the message to January 1970.

``resolve_relative`` finds one simple relative or calendar expression in a query and returns the time range
it names, relative to a reference time (UTC days): ``today``, ``yesterday``, ``this/last/past week``,
``this/last/past month``, ``this/last year``, ``N days/weeks/months ago``, ``last weekend``, ``last <weekday>``,
``in/during <Month> [year]``, ``<Month> <year>``, ``in <year>``. Search uses it as a soft boost (see
``services.conversations.search``), never as a filter: a query's words are not a promise about timestamps.
"""

from __future__ import annotations

import calendar
import re
from datetime import date, datetime, timedelta, timezone
from typing import Annotated, Any

import msgspec

from services.errors import InvalidInput

__all__ = ["parse_time", "time_options", "resolve_relative", "MIN_MS", "MAX_MS", "ISO_TIME_PATTERN", "TimeValue",
           "TIME_JSON_SCHEMA"]

#: 1973-03-03 in epoch ms: smaller integers are taken for epoch seconds and refused.
MIN_MS = 100_000_000_000
#: 9999-12-31T23:59:59.999Z
MAX_MS = 253_402_300_799_999
DAY = 86_400_000
#: The ISO-8601 forms accepted, exactly as the schema documents them: a date (1974-9989, a day that every
#: year's month has), optionally a time (hh:mm[:ss[.ffffff]]) and an offset (Z or +-hh:mm; none: UTC).
#: February 29 parses too but is not in the pattern (a regex cannot know leap years).
ISO_TIME_PATTERN = (
    r"^(197[4-9]|19[89]\d|[2-8]\d{3}|9[0-8]\d\d)-"
    r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
    r"(T([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d{1,6})?)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)?)?$"
)
#: A time in a request body: epoch milliseconds or an ISO-8601 string (msgspec validates the bounds and form).
TimeValue = (
    Annotated[int, msgspec.Meta(ge=100_000_000_000, le=253_402_300_799_999, description="epoch milliseconds")]
    | Annotated[str, msgspec.Meta(max_length=40, pattern=ISO_TIME_PATTERN,
                                  description="ISO-8601 date or date-time (no offset: UTC)")]
)
#: The same for MCP tools' JSON Schemas.
TIME_JSON_SCHEMA = {"oneOf": [
    {"type": "integer", "minimum": 100_000_000_000, "maximum": 253_402_300_799_999},
    {"type": "string", "maxLength": 40, "pattern": ISO_TIME_PATTERN},
]}


def parse_time(value: Any, field: str) -> int | None:
    """Epoch ms of an epoch-ms integer or an ISO-8601 string; None stays None; anything else is InvalidInput."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInput(f"{field} must be epoch milliseconds or an ISO-8601 string", details={"field": field})
    if isinstance(value, int):
        if value < MIN_MS:
            raise InvalidInput(
                f"{field} must be epoch milliseconds (at least {MIN_MS}); {value} looks like seconds",
                details={"field": field})
        if value > MAX_MS:
            raise InvalidInput(f"{field} is after the year 9999", details={"field": field})
        return value
    if isinstance(value, str):
        text = value.strip()
        if not 4 <= len(text) <= 40:
            raise InvalidInput(f"{field} must be an ISO-8601 date or date-time", details={"field": field})
        try:
            dt = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in "zZ" else text)
        except ValueError as exc:
            raise InvalidInput(f"{field} must be an ISO-8601 date or date-time, not {value!r}",
                               details={"field": field}) from exc
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        try:
            ms = int(dt.timestamp() * 1000)
        except (OverflowError, ValueError, OSError) as exc:
            raise InvalidInput(f"{field} is out of range", details={"field": field}) from exc
        if not 0 <= ms <= MAX_MS:
            raise InvalidInput(f"{field} must be between 1970 and 9999", details={"field": field})
        return ms
    raise InvalidInput(f"{field} must be epoch milliseconds or an ISO-8601 string", details={"field": field})


def time_options(time_from: Any = None, time_to: Any = None, reference_time: Any = None) -> dict[str, int | None]:
    """The ``SearchOptions`` time fields of a search request's ``from`` / ``to`` / ``reference_time``
    (InvalidInput for a bad value)."""
    lo, hi = parse_time(time_from, "from"), parse_time(time_to, "to")
    # ``from`` after ``to`` is an empty range: it matches nothing (200, no hits), like any other empty filter
    return {"time_from": lo, "time_to": hi, "reference_time": parse_time(reference_time, "reference_time")}


_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name}
_MONTHS.update({name.lower(): i for i, name in enumerate(calendar.month_abbr) if name})
_MONTHS.pop("may", None)
_MONTHS["may"] = 5
_WEEKDAYS = {name.lower(): i for i, name in enumerate(calendar.day_name)}
_NUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
        "nine": 9, "ten": 10, "couple of": 2, "few": 3}
_MONTH_RE = "|".join(sorted(_MONTHS, key=len, reverse=True))
_PATTERNS = [
    ("today", re.compile(r"\btoday\b|\bthis morning\b|\btonight\b|\bearlier today\b")),
    ("yesterday", re.compile(r"\byesterday\b|\blast night\b")),
    ("weekend", re.compile(r"\blast weekend\b|\bover the weekend\b")),
    ("weekday", re.compile(r"\blast (" + "|".join(_WEEKDAYS) + r")\b")),
    ("ago", re.compile(r"\b(\d{1,3}|a|an|one|two|three|four|five|six|seven|eight|nine|ten|couple of|few)\s+"
                       r"(day|week|month|year)s?\s+ago\b")),
    ("week", re.compile(r"\b(this|last|past|previous)\s+week\b")),
    ("month", re.compile(r"\b(this|last|past|previous)\s+month\b")),
    ("year", re.compile(r"\b(this|last|past|previous)\s+year\b")),
    ("month_name", re.compile(r"\b(?:in|during|since|of|on|early|late|mid)?\s*(" + _MONTH_RE + r")\.?(?:\s+(\d{4}))?\b")),
    ("year_num", re.compile(r"\b(?:in|during|of)\s+((?:19|20)\d{2})\b")),
]


def _ms(d: date) -> int:
    return int(datetime(d.year, d.month, d.day, tzinfo=timezone.utc).timestamp() * 1000)


def _month_range(year: int, month: int) -> tuple[int, int]:
    start = date(year, month, 1)
    end = date(year + (month == 12), month % 12 + 1, 1)
    return _ms(start), _ms(end) - 1


def resolve_relative(query: str, reference_ms: int) -> tuple[int, int, str] | None:
    """``(from_ms, to_ms, matched text)`` of the first relative or calendar expression in ``query``, else None."""
    text = query.lower()
    today = datetime.fromtimestamp(reference_ms / 1000, tz=timezone.utc).date()
    for kind, pattern in _PATTERNS:
        m = pattern.search(text)
        if m is None:
            continue
        if kind == "today":
            return _ms(today), _ms(today) + DAY - 1, m.group(0)
        if kind == "yesterday":
            d = today - timedelta(days=1)
            return _ms(d), _ms(d) + DAY - 1, m.group(0)
        if kind == "weekend":
            saturday = today - timedelta(days=(today.weekday() - 5) % 7 or 7)
            return _ms(saturday), _ms(saturday) + 2 * DAY - 1, m.group(0)
        if kind == "weekday":
            back = (today.weekday() - _WEEKDAYS[m.group(1)]) % 7 or 7
            d = today - timedelta(days=back)
            return _ms(d), _ms(d) + DAY - 1, m.group(0)
        if kind == "ago":
            n = int(m.group(1)) if m.group(1).isdigit() else _NUM[m.group(1)]
            unit = {"day": 1, "week": 7, "month": 30, "year": 365}[m.group(2)]
            centre = today - timedelta(days=n * unit)
            slack = max(1, unit // 2) if unit > 1 else 1
            return _ms(centre - timedelta(days=slack)), _ms(centre + timedelta(days=slack)) + DAY - 1, m.group(0)
        if kind == "week":
            monday = today - timedelta(days=today.weekday())
            if m.group(1) == "this":
                return _ms(monday), _ms(today) + DAY - 1, m.group(0)
            if m.group(1) == "past":
                return _ms(today - timedelta(days=7)), _ms(today) + DAY - 1, m.group(0)
            start = monday - timedelta(days=7)
            return _ms(start), _ms(monday) - 1, m.group(0)
        if kind == "month":
            if m.group(1) == "this":
                return _month_range(today.year, today.month)[0], _ms(today) + DAY - 1, m.group(0)
            if m.group(1) == "past":
                return _ms(today - timedelta(days=31)), _ms(today) + DAY - 1, m.group(0)
            y, mo = (today.year, today.month - 1) if today.month > 1 else (today.year - 1, 12)
            return (*_month_range(y, mo), m.group(0))
        if kind == "year":
            y = today.year if m.group(1) == "this" else today.year - 1
            if m.group(1) == "past":
                return _ms(today - timedelta(days=366)), _ms(today) + DAY - 1, m.group(0)
            return _ms(date(y, 1, 1)), _ms(date(y + 1, 1, 1)) - 1, m.group(0)
        if kind == "month_name":
            name = m.group(1)
            if name in ("may", "mar", "jan", "jun", "jul", "aug", "sep", "oct", "nov", "dec", "feb", "apr") and not (
                m.group(2) or re.search(r"\b(in|during|since|of|on|early|late|mid)\s+" + name, text)
            ):
                continue  # "may" the verb, "mar" the word: a bare short name needs "in ..." or a year
            month = _MONTHS[name]
            year = int(m.group(2)) if m.group(2) else (today.year if month <= today.month else today.year - 1)
            return (*_month_range(year, month), m.group(0).strip())
        if kind == "year_num":
            y = int(m.group(1))
            return _ms(date(y, 1, 1)), _ms(date(y + 1, 1, 1)) - 1, m.group(0)
    return None
