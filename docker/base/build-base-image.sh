#!/usr/bin/env bash
# The air-gapped build path: a stand-in for python:3.11-slim when Docker Hub cannot be reached,
# built from Debian packages (debootstrap bookworm -> `docker import`). Python 3.11 and pip live
# in a venv at /opt/venv, first on PATH, so `python`, `pip` and console scripts work as in the
# official image. The image also carries what pip needs where download.pytorch.org cannot be
# reached: the wheels in $WHEEL_DIR (the torch CPU wheel) as PIP_FIND_LINKS=/opt/wheels, and
# the host's CA bundle as PIP_CERT (PyPI through a proxy that re-signs TLS).
# Build the project image on it with an empty TORCH_INDEX_URL:
#   docker/base/build-base-image.sh
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=weightserver-base:bookworm-py311 \
#       --build-arg TORCH_INDEX_URL= -t weightserver-demo .
# Skipped when the tag exists (`docker rmi weightserver-base:bookworm-py311` to rebuild).
set -euo pipefail
TAG=${BASE_IMAGE_TAG:-weightserver-base:bookworm-py311}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEEL_DIR=${WHEEL_DIR-/opt/wheels}
CA_BUNDLE=${CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG exists; not rebuilt"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap not found: apt-get install debootstrap" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root: run as root or with sudo" >&2; exit 1; }

root=$(mktemp -d /var/tmp/weightserver-base.XXXXXX)
trap 'rm -rf --one-file-system "$root"' EXIT
chmod 755 "$root"  # it becomes the image's /: mktemp's 0700 would lock every non-root user out
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR"
chroot "$root" python3 -m venv /opt/venv
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin

env_changes=(--change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
             --change "ENV LANG=C.UTF-8")
if [[ -n $WHEEL_DIR ]] && compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    mkdir -p "$root/opt/wheels"
    cp "$WHEEL_DIR"/*.whl "$root/opt/wheels/"
    env_changes+=(--change "ENV PIP_FIND_LINKS=/opt/wheels")
fi
if [[ -n $CA_BUNDLE ]]; then
    cp "$CA_BUNDLE" "$root/etc/ssl/certs/host-ca-bundle.crt"
    env_changes+=(--change "ENV PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt")
fi
tar -C "$root" --numeric-owner -c . | docker import "${env_changes[@]}" --change 'CMD ["python"]' - "$TAG"
echo "built base image $TAG"
