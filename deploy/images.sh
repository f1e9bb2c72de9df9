#!/usr/bin/env bash
# `make images`: builds the CPU server and edge images with no image registry in reach, then
# has the edge image answer one prompt through the server image. The base is Debian bookworm
# made by debootstrap from Debian's packages (its python3 is 3.11, as python:3.11-slim's).
# buildah and podman need no daemon; the vfs storage driver and chroot isolation work as root
# in a VM or a container, where overlay mounts and user namespaces may not.
# Env: MIRROR (a Debian mirror; default the first one this host's apt sources name), WHEELS (a
# folder holding torch's CPU wheel), else TORCH_FROM (pip's options for where that wheel lies, as
# server-cpu.Dockerfile takes them), PORT (the smoke run's server port, on the host network).
set -euo pipefail
cd "$(dirname "$0")/.."

# The first URI of this host's apt sources: one-line `deb [options] URI suite ...` entries, then
# deb822 `URIs:` fields, so the build fetches from where this host's apt does.
host_mirror() {
  local files=() f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.{list,sources}; do
    [ -f "$f" ] && files+=("$f")
  done
  [ ${#files[@]} -gt 0 ] || return 0
  awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; exit } }
       tolower($1) == "uris:" { print $2; exit }' "${files[@]}"
}

BUILD=$PWD/build/images
MIRROR=${MIRROR:-$(host_mirror)}
if [ -z "$MIRROR" ]; then
  echo "images: this host's apt sources name no mirror: set MIRROR to a Debian mirror" >&2
  exit 1
fi
WHEELS=${WHEELS:-/opt/wheels}
PORT=${PORT:-50071}
BASE=localhost/splitdec-base:bookworm
STORE=(--storage-driver vfs)
# Containers run by runc, which takes cgroup v1 and hybrid hosts (crun refuses hybrid ones), with
# explicit limits: without CAP_SYS_RESOURCE (a sandboxed VM) root cannot raise them to podman's
# defaults for root, about a million each.
RUN=(--runtime runc run --ulimit nofile=4096 --ulimit nproc=4096 --network host)

torch=()
if compgen -G "$WHEELS/torch-2.13.0*.whl" >/dev/null; then
  torch=(--volume "$(realpath "$WHEELS"):/wheels:ro"
         --build-arg "TORCH_FROM=--find-links /wheels")
elif [ -n "${TORCH_FROM:-}" ]; then
  torch=(--build-arg "TORCH_FROM=$TORCH_FROM")
else
  echo "images: $WHEELS holds no torch 2.13.0 wheel: set WHEELS to a folder that does, or" \
    "TORCH_FROM to pip's options for PyTorch's CPU wheel index (docs/deploying.md)" >&2
  exit 1
fi

missing=()
for tool in debootstrap buildah podman runc; do command -v $tool >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "make images needs ${missing[*]} (Debian: apt-get install ${missing[*]})" >&2
    exit 1
  fi
  apt-get update -q && apt-get install -y -q "${missing[@]}"
fi

timed() { local start=$SECONDS; "${@:2}"; echo "images: $1 in $(( SECONDS - start )) s" >&2; }

# The rootfs and the base image are made once; `podman rmi` the base to make it again.
if ! podman "${STORE[@]}" image exists $BASE; then
  rm -rf "$BUILD"/rootfs && mkdir -p "$BUILD"
  timed debootstrap debootstrap --variant=minbase --include=python3,python3-venv bookworm "$BUILD"/rootfs "$MIRROR"
  rm -rf "$BUILD"/rootfs/var/cache/apt/archives/*.deb "$BUILD"/rootfs/var/lib/apt/lists/*
  # An imported tarball has no environment: PATH and LANG as python:3.11-slim sets them.
  tar -C "$BUILD"/rootfs -c . | podman "${STORE[@]}" import -q \
    --change ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --change ENV=LANG=C.UTF-8 - $BASE >/dev/null
fi

# pip in the build trusts what this host trusts (a TLS-inspecting proxy's CA included): a
# pip.conf naming the host's CA bundle is mounted into each RUN step, and stays out of the images.
mkdir -p "$BUILD"/pip
cp /etc/ssl/certs/ca-certificates.crt "$BUILD"/pip/ca.crt
printf '[global]\ncert = /etc/xdg/pip/ca.crt\n' > "$BUILD"/pip/pip.conf
build() { timed "$1" buildah "${STORE[@]}" bud --isolation chroot \
  --build-arg BASE=$BASE --volume "$BUILD"/pip:/etc/xdg/pip:ro "${@:2}" .; }
build server "${torch[@]}" -f deploy/docker/server-cpu.Dockerfile -t splitdec-server:cpu
build edge -f deploy/docker/edge.Dockerfile -t splitdec-edge
podman "${STORE[@]}" images --filter reference='splitdec-*'

# The smoke run: a first start (the GGUF converted, the drafter bundle built into the anonymous
# /cache volume), then one answer.
server=$(podman "${STORE[@]}" "${RUN[@]}" -d splitdec-server:cpu \
  --host 127.0.0.1 --port "$PORT" --device cpu --quiet)
trap 'podman "${STORE[@]}" rm -f -v "$server" >/dev/null' EXIT
start=$SECONDS
until podman "${STORE[@]}" exec "$server" cloud-server health --server 127.0.0.1:"$PORT" \
    2>/dev/null; do
  if [ "$(podman "${STORE[@]}" inspect -f '{{.State.Running}}' "$server")" != true ] \
      || [ $(( SECONDS - start )) -gt 900 ]; then
    podman "${STORE[@]}" logs "$server"
    exit 1
  fi
  sleep 5
done
echo "images: the server serves after $(( SECONDS - start )) s" >&2
answer=$(timed answer podman "${STORE[@]}" "${RUN[@]}" --rm splitdec-edge \
  --server 127.0.0.1:"$PORT" --quiet --max-new-tokens 32 "What is the capital of France?")
echo "$answer"
[ -n "$answer" ] || { echo "images: the edge image answered nothing" >&2; exit 1; }
