"""The file store ``--files`` names: a directory (:class:`~gateway.http_api.files.LocalFileStore`) or
``s3://bucket/prefix`` (:class:`~gateway.http_api.s3_files.S3FileStore`). Above both backends, so neither
imports the other's module."""

from __future__ import annotations

from gateway.http_api.files import FileStore, LocalFileStore


def open_store(where: str) -> FileStore:
    """The store ``--files`` names: ``s3://bucket/prefix`` (object storage), else a directory."""
    if where.startswith("s3://"):
        from gateway.http_api.s3_files import S3FileStore  # boto3 is imported only when used

        store = S3FileStore(where)
        store.check()
        return store
    return LocalFileStore(where)
