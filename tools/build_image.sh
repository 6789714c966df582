#!/usr/bin/env bash
# `make image`: builds the kvtier image without pulling a base image and without network
# during the build, verifies it by running it, and saves it as an OCI archive.
#
# The root filesystem is Debian bookworm (debootstrap minbase, from the mirror apt uses) with
# kvtier installed from wheels built on this machine; the image is `FROM scratch` + that
# root filesystem. The Dockerfile (what users and release pipelines build) is built too,
# against a stand-in for its base image made from the same root filesystem, so the two
# cannot drift apart. Needs root (debootstrap, chroot, podman); installs podman, runc,
# skopeo and debootstrap with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
OUT=.scratch/image
IMAGE=localhost/kvtier:$VERSION
ARCHIVE=$OUT/kvtier-$VERSION.oci.tar
PY=.venv/bin/python
MIRROR=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
mkdir -p "$OUT"

step() { printf '\n== %s\n' "$*"; }
# pip here reads a configuration naming local indexes a machine may lack: keep its noise out.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v '^WARNING: Location' >&2); }

tools() {
  local missing=()
  for tool in podman runc skopeo debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc skopeo debootstrap >/dev/null
  fi
  # crun rejects this kind of host's cgroups; limits pinned to what the host allows.
  cat >"$OUT/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$(cat /proc/sys/kernel/pid_max):$(cat /proc/sys/kernel/pid_max)"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
  export CONTAINERS_CONF=$PWD/$OUT/containers.conf
}

base_rootfs() {
  # Debian minbase with Python, once per machine (kept in .scratch/image).
  if [ ! -f "$OUT/base.tar" ]; then
    step "debootstrap bookworm minbase from $MIRROR"
    rm -rf "$OUT/base"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$OUT/base" "$MIRROR" >"$OUT/debootstrap.log"
    rm -rf "$OUT/base/var/cache/apt/archives/"*.deb "$OUT/base/var/lib/apt/lists/"*
    tar -C "$OUT/base" -cf "$OUT/base.tar" .
    rm -rf "$OUT/base"
  fi
}

wheels() {
  step "wheels of kvtier and its dependencies"
  rm -rf .wheelhouse
  quiet_pip wheel -q --wheel-dir .wheelhouse -r requirements/base.txt
  quiet_pip wheel -q --no-deps --wheel-dir .wheelhouse .
  quiet_pip download -q --no-deps --dest .wheelhouse/nixl -r requirements/nixl.txt
  # What `pip wheel .` needs to build kvtier itself inside the Dockerfile, offline.
  quiet_pip download -q --dest .wheelhouse "setuptools>=77" wheel
}

rootfs() {
  step "root filesystem: base + kvtier in /opt/kvtier/venv, plug-in payload, user 65532"
  local root=$OUT/rootfs
  rm -rf "$root" && mkdir -p "$root"
  tar -C "$root" -xf "$OUT/base.tar"
  cp -r .wheelhouse "$root/tmp/wheels"
  chroot "$root" /usr/bin/python3 -m venv /opt/kvtier/venv
  chroot "$root" /bin/sh -c '/opt/kvtier/venv/bin/pip install -q --no-index --no-compile \
    $(ls /tmp/wheels/*.whl | grep -v -e /setuptools- -e /wheel-) \
    && /opt/kvtier/venv/bin/pip install -q --no-index --no-deps --no-compile /tmp/wheels/nixl/*.whl'

  chroot "$root" /opt/kvtier/venv/bin/pip uninstall -q -y pip
  # NIXL's expert-parallel kernels are torch extensions, unusable in this torch-free image.
  rm -rf "$root"/opt/kvtier/venv/lib/python3*/site-packages/nixl_ep_cu12
  rm -rf "$root/tmp/wheels"
  # The plug-in payload, from the kvtier just installed there: the plug-in's packages only
  # (tools/plugin_payload.py), as the Dockerfile makes it from its source.
  local site
  site=$(chroot "$root" /opt/kvtier/venv/bin/python -c 'import kvtier, os; print(os.path.dirname(os.path.dirname(kvtier.__file__)))')
  "$PY" tools/plugin_payload.py "$root$site" "$root/opt/kvtier/plugin"
  chroot "$root" /usr/sbin/groupadd --gid 65532 kvtier
  chroot "$root" /usr/sbin/useradd --uid 65532 --gid 65532 --no-create-home \
    --shell /usr/sbin/nologin kvtier
  find "$root" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$root" -cf "$OUT/rootfs.tar" .
  rm -rf "$root"
}

build() {
  step "podman build (FROM scratch, no network)"
  cat >"$OUT/Containerfile" <<FILE
FROM scratch
ADD rootfs.tar /
ENV PATH=/opt/kvtier/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL org.opencontainers.image.source="https://kvtier.io/source" \\
      org.opencontainers.image.version="$VERSION" \\
      org.opencontainers.image.revision="$REVISION" \\
      org.opencontainers.image.title="kvtier" \\
      org.opencontainers.image.licenses="Apache-2.0"
USER 65532:65532
ENTRYPOINT ["kvtier"]
CMD ["--help"]
FILE
  podman build -q --network=none -t "$IMAGE" -f "$OUT/Containerfile" "$OUT" >/dev/null
  rm -f "$OUT/rootfs.tar"
}

dockerfile() {
  step "Dockerfile, against a stand-in for python:3.11-slim made from the same base"
  local stand=$OUT/stand-in
  rm -rf "$stand" && mkdir -p "$stand"
  tar -C "$stand" -xf "$OUT/base.tar"
  # python:3.11-slim has python and pip on PATH in /usr/local.
  chroot "$stand" /usr/bin/python3 -m venv /usr/local
  tar -C "$stand" -cf "$OUT/stand-in.tar" . && rm -rf "$stand"
  printf 'FROM scratch\nADD stand-in.tar /\nENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n' \
    >"$OUT/Containerfile.base"
  podman build -q --network=none -t localhost/python:3.11-slim -f "$OUT/Containerfile.base" "$OUT" >/dev/null
  rm -f "$OUT/stand-in.tar"
  podman build -q --network=none --build-arg BASE=localhost/python:3.11-slim \
    --build-arg PIP_OPTIONS="--no-index --find-links=/src/.wheelhouse --find-links=/src/.wheelhouse/nixl" \
    --build-arg VERSION="$VERSION" --build-arg REVISION="$REVISION" \
    -t localhost/kvtier-dockerfile:"$VERSION" -f Dockerfile . >/dev/null
  podman run --rm localhost/kvtier-dockerfile:"$VERSION" --help >/dev/null
  [ "$(podman run --rm --entrypoint id localhost/kvtier-dockerfile:"$VERSION" -u):$(podman run --rm --entrypoint id localhost/kvtier-dockerfile:"$VERSION" -g)" = "65532:65532" ]
  echo "Dockerfile image: $(podman image inspect --format '{{.Size}}' localhost/kvtier-dockerfile:"$VERSION") bytes, runs as 65532:65532"
}

tools
base_rootfs
wheels
rootfs
build
step "verifying $IMAGE by running it"
"$PY" tools/verify_image.py "$IMAGE"
podman save -q --format oci-archive -o "$ARCHIVE" "$IMAGE"
"$PY" tools/verify_image.py --archive "$ARCHIVE" --version "$VERSION" --revision "$REVISION"
dockerfile
rm -rf .wheelhouse
