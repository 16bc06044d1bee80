"""Conversation values: what the conversation services take and return (also the API's read models)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from services.models import IndexingState
from services.text.temporal import TimeValue

__all__ = [
    "ROLES",
    "MessageIn",
    "Conversation",
    "Message",
    "ConversationDetail",
    "ConversationPage",
    "MessagePage",
    "AppendedMessage",
    "AppendResult",
    "BackfillResult",
]

ROLES = ("user", "assistant", "system", "tool")
MAX_MESSAGES_PER_APPEND = 100


class MessageIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One message to append. The size of ``content`` is limited in UTF-8 bytes (413 above)."""

    role: Annotated[str, msgspec.Meta(pattern="^(user|assistant|system|tool)$", description="user, assistant, system or tool")]
    content: str
    metadata: dict[str, Any] | None = None
    #: The caller's own id for this message: appending it again (a retry) returns the original instead.
    client_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    #: When the message was said: epoch milliseconds, or an ISO-8601 date or date-time (no offset: UTC).
    #: Default: the append's own ``created_at``, else the time of the append. Search filters on it (from / to).
    created_at: TimeValue | None = None
    #: The same as ``created_at``, for clients that call it so (created_at wins when both are given).
    ts: TimeValue | None = None
    #: Your label for the session the message belongs to (e.g. "session 4" or a date); default: the append's.
    session: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None


class Conversation(msgspec.Struct, kw_only=True):
    id: str
    title: str | None
    metadata: dict[str, Any]
    message_count: int
    created_at: int
    updated_at: int


class Message(msgspec.Struct, kw_only=True):
    id: str
    conversation_id: str
    sequence: int
    role: str
    #: Exactly as appended (stored compressed, returned decompressed).
    content: str
    metadata: dict[str, Any]
    client_id: str | None
    #: Epoch ms: the time given on append (created_at / ts), else the time of the append.
    created_at: int
    session: str | None = None
    #: How the message is stored at rest: "gzip+base64" (compressed), "raw" (under 128 bytes: too small to gain) or
    #: null (a legacy row stored as given, until `memex conversations backfill-compress` compresses it).
    content_encoding: str | None = None


class ConversationDetail(Conversation, kw_only=True):
    #: One page of messages in sequence order (see ``next_from``).
    messages: list[Message]
    #: Pass as ``from`` to get the next page of messages; null when this page reaches the end.
    next_from: int | None
    indexing: IndexingState


class ConversationPage(msgspec.Struct, kw_only=True):
    conversations: list[Conversation]
    #: Pass as ``before`` to get the next page; null on the last page.
    next_before: str | None


class MessagePage(msgspec.Struct, kw_only=True):
    conversation_id: str
    messages: list[Message]
    next_from: int | None


class AppendedMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    sequence: int
    client_id: str | None = None


class AppendResult(msgspec.Struct, kw_only=True):
    conversation_id: str
    #: How many messages this result accounts for (the messages of the request, in its order).
    appended: int
    #: How many of them were already stored by an earlier call with the same client_id (a retry).
    replayed: int
    messages: list[AppendedMessage]
    message_count: int


class BackfillResult(msgspec.Struct, kw_only=True):
    #: Legacy (uncompressed) rows looked at by this batch.
    processed: int
    #: Of those, how many are now gzip+base64 and how many were small enough to stay raw.
    compressed: int
    raw: int
    bytes_before: int
    bytes_after: int
    #: Legacy rows of the organization still uncompressed after this batch.
    remaining: int
    #: Pass as ``cursor`` to resume with the next batch; null when this batch finished the job.
    next_cursor: str | None
    done: bool
