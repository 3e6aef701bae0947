"""The HTTP front's files in S3-compatible object storage (``--files s3://bucket/prefix``), through ``boto3``.

:class:`S3FileStore` is the :class:`gateway.http_api.files.FileStore` of a deployment whose
gateways run on several machines (replicas, clouds): each file is the object ``<prefix>/<id>``
plus its file object ``<prefix>/<id>.json``, written in that order (a reader that finds the
``.json`` finds the bytes; one PUT replaces an object whole, so a gateway that dies mid-write
leaves the previous version or nothing under the id). Deleting removes the ``.json`` first.

**Streams.** ``put`` never holds more than one part: bytes are gathered to ``part_bytes`` (8 MiB) and
sent as one PUT when the file is no larger, else as a multipart upload, one part at a time (aborted
when the write fails; a gateway killed mid-upload leaves an incomplete upload, which a bucket
lifecycle rule ``AbortIncompleteMultipartUpload`` clears). ``chunks`` streams the object's body and,
when the connection breaks mid-body, resumes from the byte it reached (``Range``, ``If-Match`` on the
object's ETag: a replaced object is not mixed with the old one), up to ``READ_ATTEMPTS`` times.

**Configuration** is the AWS SDK's own (boto3 reads it): the endpoint from ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` (MinIO, Ceph, GCS's XML API, R2...; path-style addressing then, unless the
shared config file sets ``s3.addressing_style``), the region from ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared files, a web identity (EKS's IRSA) or the
instance's role. Retries are botocore's ``standard`` mode (exponential backoff with jitter on
throttling, 5xx and connection errors), ``MAX_ATTEMPTS`` attempts per call unless
``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` say otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gateway.http_api.files import CHUNK, FILE_ID_RE, FileInfo, StoreUnavailable, TooLarge

log = logging.getLogger(__name__)

SCHEME = "s3://"
PART_BYTES = 8 << 20  # a multipart upload's part (S3's smallest is 5 MiB; 10,000 parts: 80 GB a file)
MAX_ATTEMPTS = 8  # botocore's attempts per call (standard mode: backoff with jitter, at most 20 s apart)
READ_ATTEMPTS = 5  # a body read that breaks resumes from where it was, this many times
LIST_THREADS = 8  # file objects read at once by ``files``
_MISSING = ("NoSuchKey", "404", "NotFound")


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix`` (the prefix may be empty; no slashes at its ends)."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket (s3://BUCKET/PREFIX)")
    return bucket, prefix.strip("/")


def client_config() -> Config:
    """The client's retry settings: standard mode, ``MAX_ATTEMPTS``, unless the environment sets them."""
    retries = {
        "mode": os.environ.get("AWS_RETRY_MODE", "standard"),
        "total_max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS),
    }
    return Config(retries=retries, connect_timeout=10, read_timeout=60, max_pool_connections=LIST_THREADS * 2)


def _missing(e: ClientError) -> bool:
    return str(e.response.get("Error", {}).get("Code")) in _MISSING


class S3FileStore:
    """Files as objects under ``s3://bucket/prefix``. What S3 refuses or fails once botocore's retries are spent
    is :class:`~gateway.http_api.files.StoreUnavailable` (the HTTP front's 503), naming the store and the cause."""

    def __init__(self, url: str, client=None, part_bytes: int = PART_BYTES) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"{SCHEME}{self.bucket}/{self.prefix}"
        self.s3 = client if client is not None else boto3.client("s3", config=client_config())
        self.part_bytes = part_bytes

    def __str__(self) -> str:
        return self.url

    def _key(self, file_id: str, meta: bool = False) -> str:
        if not FILE_ID_RE.fullmatch(file_id):
            raise FileNotFoundError(file_id)
        name = file_id + (".json" if meta else "")
        return f"{self.prefix}/{name}" if self.prefix else name

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError) as e:
            raise StoreUnavailable(f"the file store {self.url} could not {what}: {e}") from e

    def check(self) -> None:
        """Fail early (at the gateway's start) when the bucket cannot be listed: a clear error, not a 500 later."""
        try:
            self.s3.list_objects_v2(Bucket=self.bucket, Prefix=self._key("file-" + "0" * 24), MaxKeys=1)
        except (ClientError, BotoCoreError) as e:
            raise OSError(f"the file store {self.url} cannot be listed: {e}") from e

    def put(
        self, file_id: str, filename: str, purpose: str, chunks: Iterable[bytes], max_bytes: int = 0
    ) -> FileInfo:
        key = self._key(file_id)
        with self._failing(f"store {file_id}"):
            size = self._upload(key, chunks, max_bytes)
        info = FileInfo(file_id, size, int(time.time()), filename, purpose)
        body = json.dumps(info.as_json()).encode()
        try:
            with self._failing(f"store {file_id}"):
                self.s3.put_object(Bucket=self.bucket, Key=self._key(file_id, meta=True), Body=body)
        except StoreUnavailable:  # no file object: the bytes would never be listed, read or expired
            with contextlib.suppress(ClientError, BotoCoreError):
                self.s3.delete_object(Bucket=self.bucket, Key=key)
            raise
        return info

    def _upload(self, key: str, chunks: Iterable[bytes], max_bytes: int) -> int:
        """Write ``chunks`` to ``key``: one PUT when they fit in a part, else a multipart upload; the size."""
        buf, size, upload_id, parts = bytearray(), 0, None, []
        try:
            for chunk in chunks:
                size += len(chunk)
                if max_bytes and size > max_bytes:
                    raise TooLarge(f"the file has more than {max_bytes} bytes, the limit")
                buf += chunk
                while len(buf) >= self.part_bytes:
                    if upload_id is None:
                        upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
                    parts.append(self._part(key, upload_id, len(parts) + 1, bytes(buf[: self.part_bytes])))
                    del buf[: self.part_bytes]
            if upload_id is None:
                self.s3.put_object(Bucket=self.bucket, Key=key, Body=bytes(buf))
                return size
            if buf or not parts:
                parts.append(self._part(key, upload_id, len(parts) + 1, bytes(buf)))
            self.s3.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
            upload_id = None
            return size
        finally:
            if upload_id is not None:  # the write failed: free the parts sent
                try:
                    self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                except (ClientError, BotoCoreError) as e:
                    log.warning("cannot abort the multipart upload of %s: %s", key, e)

    def _part(self, key: str, upload_id: str, number: int, data: bytes) -> dict:
        done = self.s3.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        return {"PartNumber": number, "ETag": done["ETag"]}

    def info(self, file_id: str) -> FileInfo | None:
        try:
            with self._failing(f"read the file object of {file_id}"):
                try:
                    got = self.s3.get_object(Bucket=self.bucket, Key=self._key(file_id, meta=True))
                    with contextlib.closing(got["Body"]) as body:
                        return FileInfo(**json.loads(body.read()))
                except ClientError as e:
                    if _missing(e):
                        return None
                    raise
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # not a file object of this store
            return None

    def chunks(self, file_id: str) -> Iterator[bytes]:
        """The object's body in chunks; a read that breaks resumes where it was (same ETag)."""
        key, done, etag, failures = self._key(file_id), 0, None, 0
        while True:
            extra = {"Range": f"bytes={done}-", "IfMatch": etag} if etag else {}
            with self._failing(f"read {file_id}"):
                try:
                    got = self.s3.get_object(Bucket=self.bucket, Key=key, **extra)
                except ClientError as e:
                    if _missing(e) and etag is None:
                        raise FileNotFoundError(file_id) from None
                    raise
            etag = etag or got["ETag"]
            size = done + int(got.get("ContentLength", 0))
            try:
                with contextlib.closing(
                    got["Body"]
                ) as body:  # the connection goes back to the pool however it ends
                    for chunk in body.iter_chunks(CHUNK):
                        done += len(chunk)
                        yield chunk
                return
            except (BotoCoreError, OSError) as e:  # the connection broke mid-body
                if done >= size:  # it broke after the last byte: nothing is left to resume
                    return
                failures += 1
                if failures >= READ_ATTEMPTS:
                    raise StoreUnavailable(f"the file store {self.url} could not read {file_id}: {e}") from e
                log.warning("reading %s broke at byte %d (%s); resuming", key, done, e)
                time.sleep(min(5.0, 0.2 * 2**failures))

    def delete(self, file_id: str) -> bool:
        """The file object goes first (``info`` is None from then on), then the bytes."""
        if self.info(file_id) is None:
            return False
        with self._failing(f"delete {file_id}"):
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(file_id, meta=True))
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(file_id))
        return True

    def files(self) -> Iterator[FileInfo]:
        """Lists the prefix, then reads the file objects, ``LIST_THREADS`` at a time."""
        start = f"{self.prefix}/" if self.prefix else ""
        ids = []
        with self._failing("list its files"):
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(start) :]
                    if name.endswith(".json") and FILE_ID_RE.fullmatch(name[: -len(".json")]):
                        ids.append(name[: -len(".json")])
        with ThreadPoolExecutor(LIST_THREADS) as pool:
            yield from (info for info in pool.map(self.info, ids) if info is not None)
