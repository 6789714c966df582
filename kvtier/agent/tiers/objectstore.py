"""The object-storage tier: any S3-compatible endpoint, through boto3.

Objects use the same layout and header as the filesystem tier. Existence checks of a batch
run in parallel on the tier's thread pool; keys known to be present (written or listed by
this agent) need no request, and keys found absent are not asked for again for
`negativeCacheSeconds`. Capacity is enforced over the objects this agent knows (its own
writes plus a listing of the prefix at start), evicting the least recently used.
Credentials come from a mounted directory or the environment and are never logged.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.tiers.base import HEADER_BYTES, BlobTier, CorruptChunk, TierUsage
from kvtier.api.config import ObjectStoreTierConfig

log = logging.getLogger("kvtier.agent.tiers.objectstore")

S3Error = (BotoCoreError, ClientError)
_READ_BLOCK = 1 << 20


def _is_absent(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchKey", "NotFound"}


def _read_payload(body: Any, out: memoryview, length: int) -> int:
    """Up to `length` bytes of a streamed object body into `out`, a block at a time; returns
    the bytes read (fewer where the object ends early)."""
    done = 0
    while done < length:
        block = body.read(min(_READ_BLOCK, length - done))
        if not block:
            break
        out[done : done + len(block)] = block
        done += len(block)
    return done


def make_s3_client(config: ObjectStoreTierConfig) -> Any:
    credentials: dict[str, str] = {}
    if config.credentials_dir is not None:
        files = {
            "aws_access_key_id": "accessKeyId",
            "aws_secret_access_key": "secretAccessKey",
            "aws_session_token": "sessionToken",
        }
        for arg, name in files.items():
            path = config.credentials_dir / name
            if path.exists():
                credentials[arg] = path.read_text().strip()
    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.endpoint,
        region_name=config.region,
        config=Config(
            connect_timeout=config.timeout_seconds,
            read_timeout=config.timeout_seconds,
            retries={"max_attempts": config.retries + 1, "mode": "standard"},
            max_pool_connections=config.max_concurrency,
        ),
        **credentials,
    )


class ObjectStoreTier(BlobTier[ObjectStoreTierConfig]):
    kind = "objectStore"
    blob = "object"

    def __init__(self, name: str, config: ObjectStoreTierConfig) -> None:
        super().__init__(name, config, config.prefix)
        self.bucket = config.bucket
        self.s3 = make_s3_client(config)
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix=f"s3-{name}")
        self._known: OrderedDict[str, int] = OrderedDict()  # object key -> size, LRU first
        self._absent: dict[str, float] = {}
        self._listed = False

    # --- reads and writes --------------------------------------------------------------

    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        self.learn_namespace(namespace)
        names = [self.blob_name(namespace, k) for k in keys]
        now = time.monotonic()
        answer: dict[str, bool] = {}
        with self._lock:
            for n in names:
                if n in self._known:
                    answer[n] = True
                elif self._absent.get(n, 0.0) > now:
                    answer[n] = False
        unknown = [n for n in dict.fromkeys(names) if n not in answer]
        for name, found in zip(unknown, self._pool.map(self._head, unknown), strict=True):
            answer[name] = found
        return [answer[n] for n in names]

    def _head(self, name: str) -> bool:
        try:
            response = self.s3.head_object(Bucket=self.bucket, Key=name)
        except ClientError as exc:
            if _is_absent(exc):
                with self._lock:
                    self._absent[name] = time.monotonic() + self.config.negative_cache_seconds
                return False
            raise
        with self._lock:
            self._remember(name, int(response["ContentLength"]))
        return True

    def write(self, header: ChunkHeader, payload: memoryview) -> None:
        name = self.blob_name(header.namespace, header.key)
        self.learn_namespace(header.namespace)
        with self._lock:
            if name in self._known:
                return
        body = header.page() + bytes(payload[: header.length])
        self.s3.put_object(Bucket=self.bucket, Key=name, Body=body)
        with self._lock:
            self._remember(name, len(body))
            self._absent.pop(name, None)

    def read_into(self, namespace: str, key: bytes, out: memoryview) -> ChunkHeader | None:
        name = self.blob_name(namespace, key)
        try:
            response = self.s3.get_object(Bucket=self.bucket, Key=name)
        except ClientError as exc:
            if _is_absent(exc):
                with self._lock:
                    self._forget(name)
                return None
            raise
        body = response["Body"]
        try:
            header = self.checked_read(
                body.read(HEADER_BYTES),
                namespace,
                key,
                out,
                lambda header: _read_payload(body, out, header.length),
            )
        except CorruptChunk:
            self._delete(name)
            raise
        finally:
            body.close()
        with self._lock:
            self._remember(name, HEADER_BYTES + header.length)
        return header

    def probe(self) -> bool:
        """The bucket itself, as the known-objects cache answers most existence checks."""
        self.s3.head_bucket(Bucket=self.bucket)
        return True

    # --- upkeep ------------------------------------------------------------------------

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.config.capacity, self._used, len(self._known))

    def maintain(self) -> int:
        if not self._listed:
            self._list_existing()
        evicted = 0
        while True:
            with self._lock:
                if self._used <= self.config.capacity or not self._known:
                    break
                name = next(iter(self._known))
                self._forget(name)
            self._delete(name)
            evicted += 1
        return evicted

    def _list_existing(self) -> None:
        """Account for objects already under the prefix, oldest first (a restart, or other
        agents sharing the bucket)."""
        found: list[tuple[Any, str, int]] = []
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.config.prefix):
            for obj in page.get("Contents", []):
                found.append((obj["LastModified"], obj["Key"], int(obj["Size"])))
        with self._lock:
            for _modified, name, size in sorted(found):
                if name not in self._known:
                    self._known[name] = size
                    self._known.move_to_end(name, last=False)
                    self._used += size
                    self._report(name, False)
            self._listed = True

    def _remember(self, name: str, size: int) -> None:
        if name not in self._known:
            self._used += size
            self._report(name, False)
        self._known[name] = size
        self._known.move_to_end(name)

    def _forget(self, name: str) -> None:
        size = self._known.pop(name, None)
        if size is not None:
            self._used -= size
            self._report(name, True)

    def _report(self, name: str, removed: bool) -> None:
        """A chunk known held, or known gone (evicted, found absent, found corrupt): the
        tier's KV events (lock held; the events' own lock is taken after this one)."""
        chunk = self.chunk_of(name)
        if chunk is not None:
            self.holdings(chunk[0], [chunk[1]], removed)

    def _delete(self, name: str) -> None:
        with self._lock:
            self._forget(name)
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=name)
        except S3Error as exc:
            log.warning("tier %s: could not delete an object: %s", self.name, type(exc).__name__)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
