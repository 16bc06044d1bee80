"""Conversations: verbatim messages, appended and chunked into windows and turns (``conversations``), their
request and response Structs (``models``), compression at rest (``compression``) and their search hits
(``search``)."""
