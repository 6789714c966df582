"""The object-storage tier against moto's S3 server over HTTP on loopback, plus the faults:
unreachable endpoint, throttling, corrupt objects."""

from __future__ import annotations

import http.server
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import BotoCoreError

from kvtier.agent.chunk import ChunkHeader, checksum
from kvtier.agent.tiers.base import CorruptChunk
from kvtier.agent.tiers.objectstore import ObjectStoreTier
from kvtier.api.config import ObjectStoreTierConfig
from tests.conftest import free_port
from tests.helpers import NS, key, row

ROW = 16 * 1024


def make_tier(bucket: dict[str, Any], **overrides: Any) -> ObjectStoreTier:
    fields = {k: v for k, v in bucket.items() if k != "client"}
    return ObjectStoreTier("s3", ObjectStoreTierConfig.model_validate({**fields, **overrides}))


def put(tier: ObjectStoreTier, i: int) -> None:
    data = row(i, ROW)
    tier.write(ChunkHeader(NS, key(i), ROW, checksum(data.data)), data.data)


def get(tier: ObjectStoreTier, i: int) -> np.ndarray | None:
    out = np.zeros(ROW, np.uint8)
    return out if tier.read_into(NS, key(i), out.data) is not None else None


def test_roundtrip_and_layout(s3_bucket: dict[str, Any]) -> None:
    tier = make_tier(s3_bucket)
    put(tier, 3)
    hexkey = key(3).hex()
    name = f"cluster-a/{NS}/{hexkey[:2]}/{hexkey[2:4]}/{hexkey}"
    head = s3_bucket["client"].head_object(Bucket=s3_bucket["bucket"], Key=name)
    assert head["ContentLength"] == 4096 + ROW
    out = get(tier, 3)
    assert out is not None and np.array_equal(out, row(3, ROW))
    assert get(tier, 4) is None


def test_batched_exists_sees_other_writers_and_caches_absence(s3_bucket: dict[str, Any]) -> None:
    writer, reader = make_tier(s3_bucket), make_tier(s3_bucket, negativeCacheSeconds=60)
    put(writer, 1)
    assert reader.exists(NS, [key(1), key(2), key(1)]) == [True, False, True]
    put(writer, 2)
    assert reader.exists(NS, [key(2)]) == [False]  # absence remembered for a while
    fresh = make_tier(s3_bucket, negativeCacheSeconds=0)
    assert fresh.exists(NS, [key(2)]) == [True]


def test_corrupt_object_is_a_miss_and_removed(s3_bucket: dict[str, Any]) -> None:
    tier = make_tier(s3_bucket)
    put(tier, 1)
    s3, bucket = s3_bucket["client"], s3_bucket["bucket"]
    name = tier.blob_name(NS, key(1))
    body = bytearray(s3.get_object(Bucket=bucket, Key=name)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=name, Body=bytes(body))
    with pytest.raises(CorruptChunk):
        get(tier, 1)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=name)
    assert get(tier, 1) is None


def test_capacity_evicts_least_recently_used(s3_bucket: dict[str, Any]) -> None:
    blob = 4096 + ROW
    tier = make_tier(s3_bucket, capacity=4 * blob)
    for i in range(4):
        put(tier, i)
    get(tier, 0)
    put(tier, 4)
    assert tier.maintain() == 1
    assert tier.exists(NS, [key(i) for i in range(5)]) == [True, False, True, True, True]
    assert tier.usage().used_bytes == 4 * blob


def test_restart_accounts_existing_objects(s3_bucket: dict[str, Any]) -> None:
    first = make_tier(s3_bucket)
    for i in range(3):
        put(first, i)
    again = make_tier(s3_bucket)
    assert again.usage().objects == 0
    again.maintain()
    assert again.usage().objects == 3 and again.usage().used_bytes == 3 * (4096 + ROW)


def test_unreachable_endpoint_fails_within_its_timeout(s3_bucket: dict[str, Any]) -> None:
    tier = make_tier(
        s3_bucket, endpoint=f"http://127.0.0.1:{free_port()}", timeoutSeconds=0.5, retries=0
    )
    started = time.monotonic()
    with pytest.raises(BotoCoreError):
        get(tier, 1)
    assert time.monotonic() - started < 5


class ThrottlingProxy(http.server.ThreadingHTTPServer):
    """Answers the first `throttle` requests with S3's 503 SlowDown, then forwards."""

    def __init__(self, upstream: str, throttle: int) -> None:
        self.upstream, self.throttle, self.seen = upstream, throttle, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                proxy.seen += 1
                if proxy.seen <= proxy.throttle:
                    payload = b"<Error><Code>SlowDown</Code><Message>slow down</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                request = urllib.request.Request(
                    proxy.upstream + self.path,
                    data=body,
                    method=self.command,
                    headers={k: v for k, v in self.headers.items() if k.lower() != "host"},
                )
                try:
                    with urllib.request.urlopen(request, timeout=10) as resp:
                        status, headers, data = resp.status, resp.headers, resp.read()
                except urllib.error.HTTPError as err:
                    status, headers, data = err.code, err.headers, err.read()
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in {"content-length", "transfer-encoding", "connection"}:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def throttling_proxy(s3_server: str) -> Iterator[ThrottlingProxy]:
    proxy = ThrottlingProxy(s3_server, throttle=2)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()


def test_throttled_requests_are_retried(
    s3_bucket: dict[str, Any], throttling_proxy: ThrottlingProxy
) -> None:
    put(make_tier(s3_bucket), 1)
    port = throttling_proxy.server_address[1]
    tier = make_tier(s3_bucket, endpoint=f"http://127.0.0.1:{port}", retries=3)
    out = get(tier, 1)
    assert out is not None and np.array_equal(out, row(1, ROW))
    assert throttling_proxy.seen == 3  # two SlowDown answers, then the real one
