"""An uploaded vault archive (``.zip``, ``.tar.gz``/``.tgz`` or plain ``.tar``), read safely and all-or-nothing.

The kind is told by the magic bytes, never by a name. Every member is checked before anything is returned:
a bad name (absolute, backslash, ``..``), a link, a device or fifo, a duplicate, an encrypted member, a damaged
archive, or too much data refuses the whole archive with ``InvalidInput`` (``PayloadTooLarge`` for the sizes)
whose ``details`` are ``{"reason": <code>, "member": <name, at most 200 characters>}``.

Sizes are counted on the bytes actually inflated, read in chunks, so a decompression bomb is stopped after a
few MiB (declared sizes only ever refuse early, they are never trusted to accept). A gzip stream is inflated
here, chunk by chunk, under the same limits, then read to its end so that truncation and bad CRCs are caught.
"""

from __future__ import annotations

import io
import re
import stat
import tarfile
import unicodedata
import zipfile
import zlib
from collections.abc import Collection, Iterator
from typing import IO

from services.errors import InvalidInput, MemexError, PayloadTooLarge

__all__ = ["read_archive", "MAX_ARCHIVE_BYTES", "MAX_UNPACKED_BYTES", "MAX_MEMBERS", "MAX_RATIO", "BOMB_MIN_BYTES",
           "REASONS"]

MiB = 1024 * 1024
MAX_ARCHIVE_BYTES = 64 * MiB  # the request body
MAX_UNPACKED_BYTES = 256 * MiB  # total of every member, uncompressed
MAX_MEMBERS = 20_000
MAX_RATIO = 100  # unpacked / packed bytes above this (and above BOMB_MIN_BYTES unpacked) is a bomb
BOMB_MIN_BYTES = 10 * MiB
#: How much is read (and inflated) at a time.
CHUNK = 64 * 1024
#: Tar headers and padding allowed on top of MAX_UNPACKED_BYTES in a gzip stream (per member, generously).
TAR_OVERHEAD_PER_MEMBER = 4096
MEMBER_SHOWN = 200

REASONS = ("not_an_archive", "corrupt", "absolute_path", "path_traversal", "link", "special_file", "duplicate",
           "too_many_members", "too_large", "bomb", "encrypted")
#: The reasons that are sizes: PayloadTooLarge (413) rather than InvalidInput (400).
SIZE_REASONS = frozenset({"too_large", "bomb"})

_DRIVE = re.compile(r"^[A-Za-z]:")
_GZIP_MAGIC = b"\x1f\x8b"


class _Refused(Exception):
    """Why the archive is refused (turned into InvalidInput / PayloadTooLarge by read_archive)."""

    def __init__(self, reason: str, member: str = "", detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.member, self.detail = reason, member[:MEMBER_SHOWN], detail

    def message(self) -> str:
        m = self.member
        texts = {
            "not_an_archive": "the upload is not a .zip, .tar.gz or .tar archive",
            "corrupt": f"the archive is damaged or truncated{f' at {m!r}' if m else ''}"
                       f"{f': {self.detail}' if self.detail else ''}",
            "absolute_path": f"archive member {m!r} has an absolute path or a backslash",
            "path_traversal": f"archive member {m!r} has a '..' in its path",
            "link": f"archive member {m!r} is a symbolic or hard link",
            "special_file": f"archive member {m!r} is a device, a fifo or another special file",
            "duplicate": f"the archive holds {m!r} twice",
            "too_many_members": f"the archive has more than {MAX_MEMBERS} members",
            "too_large": self.detail or f"the archive unpacks to more than {MAX_UNPACKED_BYTES // MiB} MiB",
            "bomb": f"the archive expands more than {MAX_RATIO} times its size (a decompression bomb)",
            "encrypted": f"archive member {m!r} is encrypted",
        }
        return texts[self.reason]

    def error(self) -> MemexError:
        cls = PayloadTooLarge if self.reason in SIZE_REASONS else InvalidInput
        return cls(self.message(), details={"reason": self.reason, "member": self.member})


def read_archive(data: bytes, *, keep_top: Collection[str] = ()) -> dict[str, bytes]:
    """{posix path -> bytes} of every regular file of the archive, or the whole archive refused. A single top folder
    every file sits under is dropped (GitHub's ``repo-main/``) unless its name is in ``keep_top`` (a vault's own
    folders, ``docs``, ``data``: the paths that give entries their types)."""
    try:
        if len(data) > MAX_ARCHIVE_BYTES:
            raise _Refused("too_large", detail=f"the archive is larger than {MAX_ARCHIVE_BYTES // MiB} MiB")
        kind = _kind(data)
        members = _read_zip(data) if kind == "zip" else _read_tar(data, gzipped=kind == "gzip")
    except _Refused as refused:
        raise refused.error() from None
    return _strip_common_folder(members, keep_top)


def _kind(data: bytes) -> str:
    if data[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if data[:2] == _GZIP_MAGIC:
        return "gzip"
    if data[257:262] == b"ustar":
        return "tar"
    raise _Refused("not_an_archive")


# -- names ------------------------------------------------------------------------------------------------


def _clean(name: str) -> str:
    """The member's normalised posix path ('' for the archive's root), or refused."""
    if "\\" in name or name.startswith("/") or _DRIVE.match(name):
        raise _Refused("absolute_path", name)
    parts = [p for p in unicodedata.normalize("NFC", name).split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _Refused("path_traversal", name)
    return "/".join(parts)


class _Members:
    """The files read so far, with the archive-wide counts and limits."""

    def __init__(self, packed: int) -> None:
        self.packed = packed
        self.files: dict[str, bytes] = {}
        self.count = 0
        self.unpacked = 0

    def admit(self, name: str) -> str:
        """Count one more member (any kind); its clean path."""
        self.count += 1
        if self.count > MAX_MEMBERS:
            raise _Refused("too_many_members", name)
        return _clean(name)

    def charge(self, name: str, n: int) -> None:
        """``n`` more bytes actually read from member ``name``."""
        self.unpacked += n
        if self.unpacked > MAX_UNPACKED_BYTES:
            raise _Refused("too_large", name)
        if self.unpacked > BOMB_MIN_BYTES and self.unpacked > MAX_RATIO * self.packed:
            raise _Refused("bomb", name)

    def declared(self, name: str, size: int) -> None:
        """Refuse early when a member's declared size alone is too much (never trusted to accept)."""
        if self.unpacked + max(size, 0) > MAX_UNPACKED_BYTES:
            raise _Refused("too_large", name)

    def add(self, path: str, name: str, chunks: Iterator[bytes]) -> bytes:
        if path in self.files:
            raise _Refused("duplicate", name)
        parts = []
        for chunk in chunks:
            self.charge(name, len(chunk))
            parts.append(chunk)
        data = self.files[path] = b"".join(parts)
        return data


def _strip_common_folder(files: dict[str, bytes], keep_top: Collection[str] = ()) -> dict[str, bytes]:
    """Without the one top-level folder every file sits under (GitHub's ``repo-main/``), if there is one and it is
    not one of ``keep_top``."""
    tops = {path.partition("/")[0] for path in files}
    if len(tops) != 1 or not all("/" in path for path in files) or tops <= set(keep_top):
        return files
    return {path.partition("/")[2]: data for path, data in files.items()}


def _chunks(fh: IO[bytes]) -> Iterator[bytes]:
    while chunk := fh.read(CHUNK):
        yield chunk


# -- zip --------------------------------------------------------------------------------------------------


def _zip_name(info: zipfile.ZipInfo) -> str:
    """The member's name; names written as UTF-8 without the UTF-8 flag (macOS, many tools) read as UTF-8."""
    if info.flag_bits & 0x800:
        return info.filename
    try:
        return info.filename.encode("cp437").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return info.filename


def _zip_check_kind(info: zipfile.ZipInfo, name: str) -> None:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise _Refused("link", name)
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise _Refused("special_file", name)
    if info.flag_bits & 0x1:
        raise _Refused("encrypted", name)


def _read_zip(data: bytes) -> dict[str, bytes]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise _Refused("corrupt", detail=str(exc)[:200]) from None
    members = _Members(len(data))
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_MEMBERS:
            raise _Refused("too_many_members", _zip_name(infos[MAX_MEMBERS]))
        for info in infos:
            _read_zip_member(archive, info, members)
    return members.files


def _read_zip_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, members: _Members) -> None:
    name = _zip_name(info)
    path = members.admit(name)
    _zip_check_kind(info, name)
    if info.is_dir() or not path:
        return
    members.declared(name, info.file_size)
    try:
        with archive.open(info) as fh:
            data = members.add(path, name, _chunks(fh))
    except _Refused:
        raise
    except (zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError, NotImplementedError, RuntimeError) as exc:
        raise _Refused("corrupt", name, str(exc)[:200]) from None
    # zipfile checks the CRC only when the compressed data ends with the declared size: a declared size smaller
    # than the data would cut the member quietly
    if len(data) != info.file_size or zlib.crc32(data) != info.CRC:
        raise _Refused("corrupt", name, "the member's size or CRC-32 does not match its data")


# -- tar (plain or gzipped) ------------------------------------------------------------------------------------


class _TarStream:
    """The tar bytes as a sequential stream (inflated here when gzipped, under the limits), keeping the last
    bytes read so that the end-of-archive block can be checked."""

    TAIL = 256 * 1024

    def __init__(self, data: bytes, *, gzipped: bool) -> None:
        self.packed = len(data)
        self.member = ""
        self._input = memoryview(data)
        self._in = 0
        self._inflater = zlib.decompressobj(wbits=31) if gzipped else None
        self._pending = bytearray()
        self._finished = False
        self.position = 0
        self._tail = bytearray()

    def read(self, size: int = -1) -> bytes:
        size = CHUNK if size is None or size < 0 else size
        if self._inflater is None:
            out = bytes(self._input[self._in:self._in + size])
            self._in += len(out)
        else:
            while len(self._pending) < size and not self._finished:
                self._inflate()
            out = bytes(self._pending[:size])
            del self._pending[:size]
        self._remember(out)
        return out

    def _remember(self, out: bytes) -> None:
        self.position += len(out)
        self._tail += out
        if len(self._tail) > 2 * self.TAIL:
            del self._tail[:-self.TAIL]

    def block_at(self, offset: int) -> bytes | None:
        """The 512 bytes at ``offset`` of the tar stream, if still held."""
        start = offset - (self.position - len(self._tail))
        if start < 0:
            return None
        return bytes(self._tail[start:start + tarfile.BLOCKSIZE])

    def _inflate(self) -> None:
        assert self._inflater is not None
        source = self._inflater.unconsumed_tail or bytes(self._input[self._in:self._in + CHUNK])
        if not self._inflater.unconsumed_tail:
            self._in += len(source)
        try:  # with no input left, zlib may still hold output (a long match cut by max_length)
            out = self._inflater.decompress(source, CHUNK)
        except zlib.error as exc:
            raise _Refused("corrupt", self.member, f"gzip: {exc}") from None
        if not source and not out and not self._inflater.eof:
            raise _Refused("corrupt", self.member, "the gzip stream is truncated")
        self._charge(len(out))
        self._pending += out
        if self._inflater.eof:
            self._next_gzip_member()

    def _charge(self, n: int) -> None:
        inflated = self.position + len(self._pending) + n
        if inflated > MAX_UNPACKED_BYTES + TAR_OVERHEAD_PER_MEMBER * MAX_MEMBERS:
            raise _Refused("too_large", self.member)
        if inflated > BOMB_MIN_BYTES and inflated > MAX_RATIO * self.packed:
            raise _Refused("bomb", self.member)

    def _next_gzip_member(self) -> None:
        """After one gzip member: another member (concatenated gzip), zero padding, or the end."""
        assert self._inflater is not None
        rest = self._inflater.unused_data + bytes(self._input[self._in:])
        self._input, self._in = memoryview(rest), 0
        if rest[:2] == _GZIP_MAGIC:
            self._inflater = zlib.decompressobj(wbits=31)
        elif rest.strip(b"\0"):
            raise _Refused("corrupt", self.member, "data after the end of the gzip stream")
        else:
            self._finished = True

    def drain(self) -> None:
        """Read to the end (gzip: checks the CRC and catches truncation), counted under the limits."""
        if self._inflater is not None:
            while self.read(CHUNK):
                pass


def _tar_check_kind(info: tarfile.TarInfo, name: str) -> bool:
    """Whether the member is a regular file to read (False: a directory, skipped); links and specials refused."""
    if info.issym() or info.islnk():
        raise _Refused("link", name)
    if info.isdir():
        return False
    if info.isreg():
        return True
    raise _Refused("special_file", name)


def _read_tar(data: bytes, *, gzipped: bool) -> dict[str, bytes]:
    stream = _TarStream(data, gzipped=gzipped)
    try:
        archive = tarfile.open(fileobj=stream, mode="r|",  # type: ignore[call-overload]
                               encoding="utf-8", errors="surrogateescape")
    except _Refused:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise _Refused("not_an_archive", detail=str(exc)[:200]) from None
    members = _Members(len(data))
    try:
        with archive:
            for info in archive:
                _read_tar_member(archive, info, members, stream)
            _check_tar_end(archive, stream)
        stream.drain()
    except _Refused:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as exc:
        raise _Refused("corrupt", stream.member, str(exc)[:200]) from None
    return members.files


def _tar_name(info: tarfile.TarInfo) -> str:
    try:
        info.name.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 (kept as surrogates by tarfile)
        return info.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return info.name


def _read_tar_member(archive: tarfile.TarFile, info: tarfile.TarInfo, members: _Members, stream: _TarStream) -> None:
    name = _tar_name(info)
    stream.member = name[:MEMBER_SHOWN]
    path = members.admit(name)
    if not _tar_check_kind(info, name) or not path:
        return
    members.declared(name, info.size)
    fh = archive.extractfile(info)
    if fh is None:
        raise _Refused("special_file", name)
    with fh:
        members.add(path, name, _chunks(fh))


def _check_tar_end(archive: tarfile.TarFile, stream: _TarStream) -> None:
    """tarfile stops quietly at a damaged or missing header: the archive must end with a zero block."""
    block = stream.block_at(archive.offset)
    if block is None or len(block) < tarfile.BLOCKSIZE or block.count(0) != tarfile.BLOCKSIZE:
        raise _Refused("corrupt", stream.member, "the tar stream does not end with an end-of-archive block")
