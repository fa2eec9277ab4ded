"""Where segments are kept: a directory (`file:///path`) or an S3-compatible bucket (`s3://bucket/prefix`), named by
the deployer in UNWIND_ARCHIVE_URL. Nothing a request sends reaches a path or a bucket name: a segment's name is
its tenant's id and the SHA-256 of its bytes, both computed here."""
from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

SEGMENT_NAME = re.compile(r"^[0-9a-f]{64}$")
SUFFIX = ".jsonl.zst"


def segment_key(tenant_id: int, sha256: str) -> str:
    if not isinstance(sha256, str) or not SEGMENT_NAME.fullmatch(sha256):
        raise ValueError(f"{sha256!r} is not a segment's SHA-256")
    return f"tenant-{int(tenant_id)}/{sha256}{SUFFIX}"


class DirectoryStore:
    def __init__(self, root: Path):
        self.root = root
        self.where = f"file://{root}"

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        if path.exists():
            return  # content-addressed: the same name holds the same bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + f".{os.getpid()}.part")
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def stamp(self, key: str) -> str | None:
        """What changes whenever the file does (or None: it is gone): a reader's cache is good while it holds. The
        inode change time is set by the kernel on every write, rename or metadata change and cannot be set back."""
        try:
            st = (self.root / key).stat()
        except FileNotFoundError:
            return None
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def names(self, tenant_id: int) -> list[str]:
        folder = self.root / f"tenant-{int(tenant_id)}"
        if not folder.is_dir():
            return []
        return sorted(p.name[:-len(SUFFIX)] for p in folder.iterdir() if p.name.endswith(SUFFIX))


class BucketStore:
    def __init__(self, bucket: str, prefix: str):
        try:
            import boto3  # only an s3:// archive needs it (the `s3` extra)
        except ImportError:
            raise ImproperlyConfigured("UNWIND_ARCHIVE_URL names an s3:// bucket but boto3 is not installed "
                                       "(pip install 'unwind[s3]').") from None
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.where = f"s3://{bucket}/{self.prefix}"
        self.client = boto3.client("s3", endpoint_url=settings.UNWIND_ARCHIVE_S3_ENDPOINT_URL or None)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def stamp(self, key: str) -> str | None:
        """The object's ETag and time (or None: it is gone), from a HEAD request: a reader's cache is good while it
        holds. A rewrite of the object, even with the same bytes, gives it a new time."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return f"{head.get('ETag')}:{head.get('LastModified')}:{head.get('ContentLength')}"

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def names(self, tenant_id: int) -> list[str]:
        folder = self._key(f"tenant-{int(tenant_id)}/")
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder):
            for item in page.get("Contents", []):
                name = item["Key"][len(folder):]
                if name.endswith(SUFFIX):
                    found.append(name[:-len(SUFFIX)])
        return sorted(found)


def archive_store(url: str | None = None):
    """The store UNWIND_ARCHIVE_URL names; ImproperlyConfigured, saying why, when it names none or a bad one."""
    url = settings.UNWIND_ARCHIVE_URL if url is None else url
    if not url:
        raise ImproperlyConfigured("UNWIND_ARCHIVE_URL is not set: name a directory (file:///path) or an "
                                   "S3-compatible bucket (s3://bucket/prefix) for the archive.")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ImproperlyConfigured(f"UNWIND_ARCHIVE_URL: {url!r} must be file:///absolute/path.")
        return DirectoryStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ImproperlyConfigured(f"UNWIND_ARCHIVE_URL: {url!r} names no bucket (s3://bucket/prefix).")
        return BucketStore(parsed.netloc, unquote(parsed.path))
    raise ImproperlyConfigured(f"UNWIND_ARCHIVE_URL: {url!r} is neither file:///path nor s3://bucket/prefix.")
