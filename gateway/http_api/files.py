"""Files of the OpenAI-compatible front (``/v1/files``): batch inputs, outputs and error files.

Behind a small interface, :class:`FileStore`: ``put`` (store bytes given in chunks under an
id, with a filename and a purpose), ``info`` (the file object or None), ``chunks`` (read it
back), ``delete`` and ``files`` (every file object, for ``GET /v1/files``). :class:`LocalFileStore` keeps each file as ``<dir>/<id>`` plus ``<dir>/<id>.json`` (its
file object), written to a temporary name and renamed, so a reader never sees half a file and
a gateway that dies mid-write leaves nothing under the id. Every gateway of a deployment must
see the same store: one directory on shared storage, or S3-compatible object storage
(:class:`gateway.http_api.s3_files.S3FileStore`); :func:`gateway.http_api.stores.open_store` makes the one ``--files`` names.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

PURPOSES = ("batch", "batch_output")
CHUNK = 1 << 20
#: the only ids the store issues: uploads (:func:`new_file_id`) and the finalizer's output and
#: error files (``file_id_of``) are both ``file-`` and 24 hex digits
FILE_ID_RE = re.compile(r"file-[0-9a-f]{24}")


@dataclass
class FileInfo:
    """OpenAI's file object."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"

    def as_json(self) -> dict:
        return asdict(self)


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class TooLarge(ValueError):
    """A file over the size limit given to ``put`` (uploads only)."""


class StoreUnavailable(OSError):
    """The store could not do what was asked (object storage down, throttling, refusing the gateway's
    credentials): the HTTP front answers 503, retry later, naming the cause."""


class FileStore(Protocol):
    def put(
        self, file_id: str, filename: str, purpose: str, chunks: Iterable[bytes], max_bytes: int = 0
    ) -> FileInfo:
        """Store the bytes of ``chunks`` under ``file_id`` (replacing a file of that id);
        :class:`TooLarge` past ``max_bytes`` (0: no bound; the front bounds uploads, not the
        finalizer's output files)."""
        ...

    def info(self, file_id: str) -> FileInfo | None:
        """The file's object, or None when there is no such file."""
        ...

    def chunks(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes, in chunks (``FileNotFoundError`` when there is no such file)."""
        ...

    def delete(self, file_id: str) -> bool:
        """Remove the file; False when there was no such file."""
        ...

    def files(self) -> Iterator[FileInfo]:
        """The object of every stored file, in no particular order."""
        ...


class LocalFileStore:
    """Files in one local (or shared) directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def __str__(self) -> str:
        return str(self.root)

    def _path(self, file_id: str) -> Path:
        """The file's path; ``FileNotFoundError`` for an id the store never issues (such as
        ``file-<id>.json``, the name of another file's object)."""
        if not FILE_ID_RE.fullmatch(file_id):
            raise FileNotFoundError(file_id)
        return self.root / file_id

    def put(
        self, file_id: str, filename: str, purpose: str, chunks: Iterable[bytes], max_bytes: int = 0
    ) -> FileInfo:
        path = self._path(file_id)
        tmp = path.with_name(f".{file_id}.{secrets.token_hex(4)}.tmp")
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    size += len(chunk)
                    if max_bytes and size > max_bytes:
                        raise TooLarge(f"the file has more than {max_bytes} bytes, the limit")
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            info = FileInfo(file_id, size, int(time.time()), filename, purpose)
            meta = path.with_name(tmp.name + ".json")
            meta.write_text(json.dumps(info.as_json()))
            os.replace(tmp, path)
            os.replace(meta, path.with_name(file_id + ".json"))
            return info
        finally:
            tmp.unlink(missing_ok=True)
            path.with_name(tmp.name + ".json").unlink(missing_ok=True)

    def info(self, file_id: str) -> FileInfo | None:
        try:
            meta = self._path(file_id).with_name(file_id + ".json")
            data = json.loads(meta.read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not self._path(file_id).exists():
            return None
        return FileInfo(**data)

    def chunks(self, file_id: str) -> Iterator[bytes]:
        with open(self._path(file_id), "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def delete(self, file_id: str) -> bool:
        """The file object goes first (``info`` is None from then on), then the bytes."""
        if self.info(file_id) is None:  # also every id the store never issues
            return False
        path = self._path(file_id)
        path.with_name(file_id + ".json").unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        return True

    def files(self) -> Iterator[FileInfo]:
        """Scans the directory (one ``<id>.json`` read per file; temporary names start with a dot)."""
        for meta in self.root.glob("*.json"):
            if meta.name.startswith("."):
                continue
            info = self.info(meta.name[: -len(".json")])
            if info is not None:
                yield info


def list_files(
    store: FileStore, limit: int, after: str | None = None, purpose: str | None = None, order: str = "desc"
) -> tuple[list[FileInfo], bool]:
    """One page of ``GET /v1/files``: files by ``(created_at, id)`` (``order`` asc or desc) after the
    file ``after`` (``ValueError`` when it is not in the list), of one ``purpose`` when given; and
    whether more follow."""
    found = [f for f in store.files() if purpose is None or f.purpose == purpose]
    found.sort(key=lambda f: (f.created_at, f.id), reverse=order == "desc")
    start = 0
    if after:
        ids = [f.id for f in found]
        if after not in ids:
            raise ValueError(f"after={after!r} is not a file of this list")
        start = ids.index(after) + 1
    page = found[start : start + limit]
    return page, start + limit < len(found)


def read_lines(store: FileStore, file_id: str) -> Iterator[bytes]:
    """The lines of a stored file (without line ends), read chunk by chunk."""
    rest = b""
    for chunk in store.chunks(file_id):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        yield from lines
    if rest:
        yield rest
