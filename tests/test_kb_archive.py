"""Uploaded vault archives: zip, tar.gz and tar round trips, and every refusal, with hand-crafted malicious
archives (zip-slip, links, devices, duplicates, bombs, lying sizes, encryption, truncation)."""

from __future__ import annotations

import gzip
import io
import random
import stat
import struct
import tarfile
import tracemalloc
import zipfile
from collections.abc import Iterable

import pytest

from services.errors import InvalidInput, MemexError, PayloadTooLarge
from services.knowledge import archive
from services.knowledge.archive import read_archive

FILES = {
    "docs/commons-lab/lab-index.md": b"---\ntitle: Lab\npublish: true\n---\n\n# Lab\n",
    "data/concepts/quorum.md": "# Quorum\n\nUne abstention compte comme présence.\n".encode(),
    "attachments/diagram.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
    "README.md": b"",
}
MiB = 1024 * 1024


# -- building archives in memory -------------------------------------------------------------------------


def make_zip(files: dict[str, bytes], *, infos: Iterable[tuple[zipfile.ZipInfo, bytes]] = (),
             compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for info, data in infos:
            info.compress_type = compression
            zf.writestr(info, data)
    return buf.getvalue()


def tar_member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **attrs: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def make_tar(files: dict[str, bytes], *, members: Iterable[tuple[tarfile.TarInfo, bytes]] = (), gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            info, payload = tar_member(name, data)
            tf.addfile(info, io.BytesIO(payload))
        for info, payload in members:
            tf.addfile(info, io.BytesIO(payload) if info.isreg() else None)
    return buf.getvalue()


def refused(data: bytes, reason: str, member: str | None = None, *, status: int = 400) -> MemexError:
    with pytest.raises(MemexError) as caught:
        read_archive(data)
    err = caught.value
    assert err.details["reason"] == reason, (err.details, err.message)
    assert isinstance(err, PayloadTooLarge if status == 413 else InvalidInput)
    assert err.status == status
    if member is not None:
        assert err.details["member"] == member
    return err


class Zeros(io.RawIOBase):
    """``size`` zero bytes, read in chunks (never held whole)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


# -- reading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [make_zip, make_tar, lambda files: make_tar(files, gz=False),
                                   lambda files: make_zip(files, compression=zipfile.ZIP_STORED)],
                         ids=["zip", "tar.gz", "tar", "zip-stored"])
def test_round_trip(build) -> None:
    assert read_archive(build(FILES)) == FILES


@pytest.mark.parametrize("build", [make_zip, make_tar], ids=["zip", "tar.gz"])
def test_a_common_top_folder_is_stripped(build) -> None:
    wrapped = {f"larchwood-vault-main/{path}": data for path, data in FILES.items()}
    assert read_archive(build(wrapped)) == FILES
    two_tops = {"a/x.md": b"x", "b/y.md": b"y"}
    assert read_archive(build(two_tops)) == two_tops
    a_file_at_the_top = {"a/x.md": b"x", "top.md": b"t"}
    assert read_archive(build(a_file_at_the_top)) == a_file_at_the_top
    # a vault whose files all sit in docs/ keeps it: that folder is content (it gives entries their paths and types)
    only_docs = {"docs/group/a.md": b"a", "docs/group/b.md": b"b"}
    assert read_archive(build(only_docs), keep_top={"docs", "data"}) == only_docs
    assert read_archive(build(only_docs)) == {"group/a.md": b"a", "group/b.md": b"b"}


def test_directories_are_skipped_and_names_normalised() -> None:
    nfd = "data/people/zoe\u0301.md"
    data = make_tar({"./docs/a.md": b"a", nfd: b"z", "docs//b.md": b"b"},
                    members=[tar_member("docs", kind=tarfile.DIRTYPE), tar_member("docs/empty", kind=tarfile.DIRTYPE)])
    assert read_archive(data) == {"docs/a.md": b"a", "data/people/zo\u00e9.md": b"z", "docs/b.md": b"b"}
    zipped = make_zip({"./x/a.md": b"a"}, infos=[(zipfile.ZipInfo("x/"), b""), (zipfile.ZipInfo("x/sub/"), b"")])
    assert read_archive(zipped) == {"a.md": b"a"}  # x/ was the common top folder


def test_empty_archives() -> None:
    assert read_archive(make_zip({})) == {}
    assert read_archive(make_tar({})) == {}


# -- refusals: names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "reason"), [
    ("../evil.md", "path_traversal"),
    ("docs/../../evil.md", "path_traversal"),
    ("docs/..", "path_traversal"),
    ("/etc/cron.d/evil", "absolute_path"),
    ("C:/Windows/evil.md", "absolute_path"),
    ("c:evil.md", "absolute_path"),
    ("docs\\..\\evil.md", "absolute_path"),
    ("docs\\evil.md", "absolute_path"),
])
@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_bad_names(name: str, reason: str, kind: str) -> None:
    if kind == "zip":
        data = make_zip(FILES, infos=[(zipfile.ZipInfo(name), b"pwned")])
    else:
        data = make_tar(FILES, members=[tar_member(name, b"pwned")])
    refused(data, reason, name)


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_duplicates() -> None:
    refused(make_zip({}, infos=[(zipfile.ZipInfo("docs/a.md"), b"1"), (zipfile.ZipInfo("docs/a.md"), b"2")]),
            "duplicate", "docs/a.md")
    refused(make_zip({"docs/a.md": b"1", "./docs/a.md": b"2"}), "duplicate", "./docs/a.md")
    refused(make_tar({"caf\u00e9.md": b"1", "cafe\u0301.md": b"2"}), "duplicate", "cafe\u0301.md")


def test_the_member_is_truncated_to_200_characters() -> None:
    name = "../" + "x" * 300 + ".md"
    err = refused(make_zip({}, infos=[(zipfile.ZipInfo(name), b"x")]), "path_traversal")
    assert err.details["member"] == name[:200]


# -- refusals: links and special files ------------------------------------------------------------------------


def test_links_and_special_files_in_tar() -> None:
    refused(make_tar(FILES, members=[tar_member("docs/passwd.md", kind=tarfile.SYMTYPE, linkname="/etc/passwd")]),
            "link", "docs/passwd.md")
    refused(make_tar(FILES, members=[tar_member("docs/hard.md", kind=tarfile.LNKTYPE, linkname="README.md")]),
            "link", "docs/hard.md")
    refused(make_tar(FILES, members=[tar_member("dev/null", kind=tarfile.CHRTYPE, devmajor=1, devminor=3)]),
            "special_file", "dev/null")
    refused(make_tar(FILES, members=[tar_member("dev/disk", kind=tarfile.BLKTYPE, devmajor=8, devminor=0)]),
            "special_file", "dev/disk")
    refused(make_tar(FILES, members=[tar_member("docs/pipe", kind=tarfile.FIFOTYPE)], gz=False), "special_file",
            "docs/pipe")


def test_links_and_special_files_in_zip() -> None:
    link = zipfile.ZipInfo("docs/passwd.md")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    refused(make_zip(FILES, infos=[(link, b"/etc/passwd")]), "link", "docs/passwd.md")
    fifo = zipfile.ZipInfo("docs/pipe")
    fifo.create_system = 3
    fifo.external_attr = (stat.S_IFIFO | 0o644) << 16
    refused(make_zip(FILES, infos=[(fifo, b"")]), "special_file", "docs/pipe")


# -- refusals: damaged archives --------------------------------------------------------------------------------


def patch(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


def test_not_an_archive() -> None:
    for data in (b"", b"# just markdown\n", b"BZh91AY&SY" + bytes(100), bytes(1024), b"PK\x01\x02nope",
                 gzip.compress(b"# a gzipped markdown file, not a tar\n" * 20)):
        refused(data, "not_an_archive")


def test_encrypted_zip_member() -> None:
    data = make_zip({"docs/secret.md": b"hidden"})
    local, central = data.index(b"PK\x03\x04"), data.index(b"PK\x01\x02")
    data = patch(data, local + 6, b"\x01\x00")
    data = patch(data, central + 8, b"\x01\x00")
    refused(data, "encrypted", "docs/secret.md")


def test_truncated_and_bad_crc() -> None:
    z = make_zip(FILES)
    refused(z[: len(z) // 2], "corrupt")
    refused(z[:-30], "corrupt")
    content = FILES["data/concepts/quorum.md"]
    stored = make_zip(FILES, compression=zipfile.ZIP_STORED)
    refused(stored.replace(content[:20], b"X" * 20), "corrupt", "data/concepts/quorum.md")  # bad CRC-32
    deflated = make_zip({"docs/a.md": b"some text " * 100})
    refused(patch(deflated, 40, b"\xff\xff"), "corrupt", "docs/a.md")  # damaged deflate data
    t = make_tar(FILES)
    refused(t[:-20], "corrupt")  # the gzip trailer is cut
    refused(t[: len(t) // 2], "corrupt")
    refused(patch(t, len(t) - 8, b"\x00\x00\x00\x00"), "corrupt")  # a wrong gzip CRC
    plain = make_tar(FILES, gz=False)
    refused(plain[:1200], "corrupt")  # cut inside a member's data
    end = plain.index(bytes(1024), 512)  # the end-of-archive blocks gone: cut at a header boundary
    refused(plain[: end], "corrupt")
    refused(plain[: end] + b"garbage!" * 128, "corrupt")  # a damaged header: tarfile alone would stop quietly


def _set_tar_size(data: bytes, header: int, size: int) -> bytes:
    """Rewrite the size field of the header at ``header``, with a valid checksum."""
    block = bytearray(data[header:header + 512])
    block[124:136] = b"%011o\0" % size
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return data[:header] + bytes(block) + data[header + 512:]


def test_declared_sizes_that_lie() -> None:
    body = b"the real content of the member, " * 200
    z = make_zip({"docs/liar.md": body})
    local, central = z.index(b"PK\x03\x04"), z.index(b"PK\x01\x02")
    smaller = patch(patch(z, local + 22, struct.pack("<I", 10)), central + 24, struct.pack("<I", 10))
    refused(smaller, "corrupt", "docs/liar.md")  # stops at the declared size: the CRC does not match
    larger = patch(patch(z, local + 22, struct.pack("<I", 10 * MiB)), central + 24, struct.pack("<I", 10 * MiB))
    refused(larger, "corrupt", "docs/liar.md")  # the data ends before the declared size
    huge = patch(patch(z, local + 22, struct.pack("<I", 2**32 - 1)), central + 24, struct.pack("<I", 2**32 - 1))
    refused(huge, "too_large", "docs/liar.md", status=413)  # refused on the declaration, nothing read

    plain = make_tar({"docs/liar.md": body}, gz=False)
    header = plain.index(b"docs/liar.md") - 0  # the ustar header of the member (after the pax header)
    header -= header % 512
    refused(_set_tar_size(plain, header, 100), "corrupt")  # the rest of the data is read as a (bad) header
    refused(_set_tar_size(plain, header, 64 * 1024), "corrupt")  # declares more than there is
    refused(_set_tar_size(plain, header, 8**11 - 1), "too_large", "docs/liar.md", status=413)


# -- refusals: sizes -------------------------------------------------------------------------------------------


def test_too_many_members(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "MAX_MEMBERS", 5)
    names = {f"docs/n{i}.md": b"x" for i in range(6)}
    refused(make_zip(names), "too_many_members", "docs/n5.md")
    refused(make_tar(names), "too_many_members", "docs/n5.md")
    assert len(read_archive(make_zip(dict(list(names.items())[:5])))) == 5


def test_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "MAX_UNPACKED_BYTES", 1 * MiB)
    noise = random.Random(7).randbytes(700 * 1024)  # does not compress
    files = {"docs/a.bin": noise, "docs/b.bin": noise[::-1]}
    for data in (make_zip(files), make_tar(files), make_tar(files, gz=False)):
        refused(data, "too_large", "docs/b.bin", status=413)
    assert read_archive(make_zip({"docs/a.bin": noise})) == {"a.bin": noise}
    monkeypatch.setattr(archive, "MAX_ARCHIVE_BYTES", 1000)
    err = refused(make_zip({"docs/a.md": b"x" * 10, "docs/b.bin": noise[:2000]}), "too_large", "", status=413)
    assert "larger than" in err.message


def _zip_bomb(size: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("docs/readme.md", b"# nothing to see\n")
        info = zipfile.ZipInfo("docs/zeros.md")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w") as out:
            chunk, left = bytes(MiB), size
            while left:
                out.write(chunk[: min(left, MiB)])
                left -= min(left, MiB)
    return buf.getvalue()


def _tar_bomb(size: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tf:
        info = tarfile.TarInfo("docs/zeros.md")
        info.size = size
        tf.addfile(info, io.BufferedReader(Zeros(size)))
    return buf.getvalue()


@pytest.mark.parametrize("build", [_zip_bomb, _tar_bomb], ids=["zip", "tar.gz"])
def test_bombs_are_refused_without_inflating_them(build) -> None:
    data = build(200 * MiB)  # 200 MiB of zeros: under MAX_UNPACKED_BYTES, but > 100 times the archive
    assert len(data) < 1 * MiB
    tracemalloc.start()
    try:
        refused(data, "bomb", "docs/zeros.md", status=413)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 48 * MiB  # stopped after a few tens of MiB, never the whole 200


def test_a_gzip_bomb_after_the_tar_end() -> None:
    """Zeros after the end-of-archive blocks are inflated under the same limits when the stream is drained."""
    tar = make_tar({"docs/a.md": b"a"}, gz=False)
    compressor = gzip.GzipFile(fileobj=(buf := io.BytesIO()), mode="wb")
    compressor.write(tar)
    zeros = bytes(MiB)
    for _ in range(64):
        compressor.write(zeros)
    compressor.close()
    refused(buf.getvalue(), "bomb", status=413)


def test_all_or_nothing() -> None:
    """One bad member refuses the archive even when it comes last, after good files were read."""
    good = {f"docs/n{i}.md": b"fine" for i in range(20)}
    refused(make_zip(good, infos=[(zipfile.ZipInfo("../../evil.md"), b"x")]), "path_traversal")
    refused(make_tar(good, members=[tar_member("docs/z", kind=tarfile.SYMTYPE, linkname="/")]), "link")
