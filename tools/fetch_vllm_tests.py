"""Extract vLLM's own tests of secondary tiers from vLLM's source distribution on PyPI (the
wheel carries no tests), for tests/vllm/test_vllm_published.py, which runs them against the
kvtier tier and accounts for every case.

The sdist (about 47 MB) is downloaded once into `<target>.sdist/`, checked against the
sha256 the package index publishes for it; from it only the tiering tests are extracted into
the target directory, afresh on every call (a second of work, no download). pip cannot fetch
it (`pip download` of an sdist builds its metadata, which for vLLM needs CUDA's torch), so
this reads the index's simple API (PEP 691) the way pip does: `PIP_INDEX_URL` when set,
else PyPI.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
FILES = (
    "tests/v1/kv_offload/tiering/test_fs_tier.py",
    "tests/v1/kv_offload/tiering/test_tiering_offloading.py",
)
COMPLETE = ".complete"


def _sdist_url() -> tuple[str, str]:
    """The sdist's URL and sha256, from the index's page of vLLM's files."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(
        f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        page = json.load(reply)
    for entry in page["files"]:
        if entry["filename"] == SDIST:
            return str(entry["url"]), str(entry["hashes"]["sha256"])
    raise SystemExit(f"{index} lists no {SDIST}")


def _sdist(cache: Path) -> Path:
    path = cache / SDIST
    if path.exists():
        return path
    url, sha256 = _sdist_url()
    cache.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.NamedTemporaryFile(dir=cache, delete=False) as tmp,
        urllib.request.urlopen(url, timeout=600) as reply,
    ):
        shutil.copyfileobj(reply, tmp)
    digest = hashlib.sha256(Path(tmp.name).read_bytes()).hexdigest()
    if digest != sha256:
        os.unlink(tmp.name)
        raise SystemExit(f"{SDIST}: sha256 {digest}, the index says {sha256}")
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)  # whole, or not at all
    return path


def main(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(_sdist(target.with_name(target.name + ".sdist"))) as sdist:
        shutil.rmtree(target, ignore_errors=True)
        for name in FILES:
            member = sdist.extractfile(f"vllm-{VERSION}/{name}")
            assert member is not None, name
            out = target / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(member.read())
    (target / COMPLETE).write_text(f"vllm=={VERSION} sdist: {len(FILES)} files\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
