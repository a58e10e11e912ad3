"""Blobs in an S3-compatible bucket (MinIO or SeaweedFS in production): ``s3://bucket/prefix``.

Credentials come from the usual AWS_* variables (the secret key may come from the file
``AWS_SECRET_ACCESS_KEY_FILE`` names, a Docker secret); the endpoint from
``FEDQ_S3_ENDPOINT_URL``. A PUT replaces an object atomically. A blob larger than the part
size (FEDQ_BLOB_CHUNK_MB, at least S3's 5 MiB) is uploaded in parts (a multipart upload,
which S3 shows only once it is complete), so one is not capped at a single PUT's 5 GB.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlparse

import fedq.digest as digests
from fedq.blobs.base import PIECE_BYTES, BlobStore
from fedq.blobs.ref import BlobRef
from fedq.errors import (
    BlobError,
    BlobNotFound,
    ConfigError,
    ServiceUnavailable,
    require_extra,
)
from fedq.redaction import redact
from fedq.settings import secret

#: S3's smallest part of a multipart upload (all but the last).
MIN_PART_BYTES = 5 << 20
#: A multipart upload's most parts and an object's most bytes (max_blob_bytes says where from).
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = 5 << 40


class S3BlobStore(BlobStore):
    def __init__(self, url: str, endpoint_url: str | None = None,
                 part_bytes: int = 64 << 20) -> None:
        """``part_bytes``: a blob larger than this is uploaded in parts of this size
        (raised to S3's 5 MiB where it is less)."""
        require_extra("boto3", "s3", f"the blob store {url}")
        import boto3
        from botocore.config import Config

        parsed = urlparse(url)
        if not parsed.netloc:
            raise ConfigError(f"FEDQ_BLOB_URL: {url!r} names no bucket (s3://bucket/prefix)")
        self.url = redact(url)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/") + "/" if parsed.path.strip("/") else ""
        keys: dict[str, str] = {}
        if os.environ.get("AWS_SECRET_ACCESS_KEY_FILE"):  # boto3 reads no *_FILE
            keys = {"aws_access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", ""),
                    "aws_secret_access_key": secret(os.environ, "AWS_SECRET_ACCESS_KEY") or ""}
        self._client: Any = boto3.client(
            "s3", endpoint_url=endpoint_url, **keys,
            config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3},
                          s3={"addressing_style": "path"}))
        self._presigners: dict[str, Any] = {}
        self.part_bytes = max(part_bytes, MIN_PART_BYTES)

    def _errors(self) -> tuple[type[Exception], ...]:
        from botocore.exceptions import BotoCoreError, ClientError

        return (BotoCoreError, ClientError)

    def _write(self, key: str, data: bytes) -> None:
        try:
            if len(data) <= self.part_bytes:
                self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)
                return
            from boto3.s3.transfer import TransferConfig

            self._client.upload_fileobj(  # a BytesIO of bytes shares them: no copy
                io.BytesIO(data), self.bucket, self.prefix + key,
                Config=TransferConfig(multipart_threshold=self.part_bytes,
                                      multipart_chunksize=self.part_bytes))
        except self._errors() as exc:
            raise BlobError(f"blob store {self.url}: cannot write {key}: {exc}") from None

    def put_whole_parts(self, key: str, parts: Sequence[Any]) -> BlobRef:
        return self._put_iterable(key, parts)

    def _put_iterable(self, key: str, parts: Iterable[Any]) -> BlobRef:
        """One PUT for a blob up to ``part_bytes``; a larger one as a multipart upload
        whose parts are sent as they fill, each part's buffer the only copy held
        (aborted on any error, so no half object is ever visible). Hashed on the way."""
        whole = digests.new()
        size = 0
        buffer = bytearray(self.part_bytes)
        fill = 0
        upload: str | None = None
        done: list[dict[str, Any]] = []

        def send() -> None:
            nonlocal upload, fill
            if upload is None:
                upload = self._client.create_multipart_upload(
                    Bucket=self.bucket, Key=self.prefix + key)["UploadId"]
            answer = self._client.upload_part(
                Bucket=self.bucket, Key=self.prefix + key, UploadId=upload,
                PartNumber=len(done) + 1, Body=bytes(memoryview(buffer)[:fill]))
            done.append({"ETag": answer["ETag"], "PartNumber": len(done) + 1})
            fill = 0

        try:
            for part in parts:
                view = memoryview(part).cast("B")
                whole.update(view)
                size += view.nbytes
                while view.nbytes:
                    take = min(view.nbytes, self.part_bytes - fill)
                    buffer[fill:fill + take] = view[:take]
                    fill += take
                    view = view[take:]
                    if fill == self.part_bytes:
                        send()
            if upload is None:
                self._client.put_object(Bucket=self.bucket, Key=self.prefix + key,
                                        Body=bytes(memoryview(buffer)[:fill]))
            else:
                if fill:
                    send()
                self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=self.prefix + key, UploadId=upload,
                    MultipartUpload={"Parts": done})
        except BaseException as exc:
            if upload is not None:
                with contextlib.suppress(*self._errors()):
                    self._client.abort_multipart_upload(Bucket=self.bucket,
                                                        Key=self.prefix + key, UploadId=upload)
            if isinstance(exc, self._errors()):
                raise BlobError(f"blob store {self.url}: cannot write {key}: {exc}") from None
            raise
        return BlobRef(key, digests.text(whole), size)

    def _read(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            obj = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            return bytes(obj["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise BlobNotFound(f"blob {key}: not found in {self.url}") from None
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        except self._errors() as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None

    read_piece_bytes = PIECE_BYTES

    def _pieces(self, key: str) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        try:
            body = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise BlobNotFound(f"blob {key}: not found in {self.url}") from None
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        except self._errors() as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None

        size = self.read_piece_bytes or PIECE_BYTES

        def read() -> Iterator[bytes]:
            try:
                while piece := body.read(size):
                    yield bytes(piece)
            except self._errors() + (OSError,) as exc:
                raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
            finally:
                body.close()

        return read()

    def _size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise BlobNotFound(f"blob {key}: not found in {self.url}") from None
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        except self._errors() as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        return int(head["ContentLength"])

    def presign(self, endpoint: str, expires_s: int, get: Sequence[str],
                put: Sequence[str]) -> dict[str, dict[str, str]]:
        """URLs that let their holder GET the keys ``get`` and PUT the keys ``put`` (and
        nothing else) at ``endpoint``, the S3 endpoint as the workers reach it, for
        ``expires_s`` seconds (fedq/blobs/presigned.py)."""
        import boto3
        from botocore.config import Config

        signer = self._presigners.get(endpoint)
        if signer is None:
            creds = self._client._request_signer._credentials  # the same key, another host
            signer = boto3.client(
                "s3", endpoint_url=endpoint, region_name=self._client.meta.region_name,
                aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key,
                config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))
            self._presigners[endpoint] = signer

        def url(method: str, key: str) -> str:
            return str(signer.generate_presigned_url(
                method, Params={"Bucket": self.bucket, "Key": self.prefix + key},
                ExpiresIn=expires_s))

        return {"get": {k: url("get_object", k) for k in get},
                "put": {k: url("put_object", k) for k in put}}

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Delete these objects, and abort the multipart uploads under any of these keys
        that a writer stopped mid-blob left unfinished (their parts are kept, and billed,
        until aborted; skipped for credentials that may not list them)."""
        for i in range(0, len(keys), 1000):  # S3's DeleteObjects takes 1,000 keys
            objects = [{"Key": self.prefix + k} for k in keys[i:i + 1000]]
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})
        if not keys:
            return
        from botocore.exceptions import ClientError

        wanted = {self.prefix + k for k in keys}
        common = self.prefix + os.path.commonprefix(list(keys))
        try:
            for page in self._client.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=common):
                for upload in page.get("Uploads", []):
                    if upload["Key"] in wanted:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("AccessDenied",
                                                                  "NotImplemented"):
                raise

    def delete_prefix(self, prefix: str) -> None:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})

    def max_blob_bytes(self) -> int:
        """A multipart upload has at most 10,000 parts, an object at most 5 TiB
        (https://docs.aws.amazon.com/AmazonS3/latest/userguide/qfacts.html)."""
        return min(MAX_PARTS * self.part_bytes, MAX_OBJECT_BYTES)

    def layout(self) -> str:
        return (f"one PUT a blob up to {self.part_bytes / 2**20:g} MiB, a larger one in "
                "parts of that size (a multipart upload; FEDQ_BLOB_CHUNK_MB, at least 5), "
                f"at most {self.max_blob_bytes() / 2**30:,.0f} GiB a blob")

    def prepare(self) -> str:
        """Create the bucket unless it exists (the compose file's s3-init step)."""
        return f"bucket {self.bucket}: {'created' if self._make_bucket() else 'exists'}"

    def _make_bucket(self) -> bool:
        try:
            self._client.create_bucket(Bucket=self.bucket)
            return True
        except self._client.exceptions.BucketAlreadyOwnedByYou:
            return False
        except self._client.exceptions.BucketAlreadyExists:
            return False
        except self._errors() as exc:
            raise ServiceUnavailable(f"blob store {self.url}: cannot create the bucket: "
                                     f"{exc}") from None

    def check(self) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self.prefix + ".check", Body=b"1")
        except self._errors() as exc:
            raise ServiceUnavailable(f"blob store {self.url} is not writable: {exc}") from None
