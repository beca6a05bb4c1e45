#!/usr/bin/env bash
# Make a local Docker engine ready for tests/test_compose_engine.py, or say why not.
#
#   docker/test-engine.sh            # prints the base image to build on, last line
#
# 1. Debian's docker.io, docker-compose and debootstrap (apt-get), if missing;
# 2. dockerd, started in the background if no daemon answers;
# 3. a base image for docker/Dockerfile without Docker Hub: Debian bookworm from
#    debootstrap (python3, pip, libnuma1, the host's CA bundle for pip), imported
#    as $OMNI_BASE_IMAGE (default omni-serving-base:bookworm). The root file
#    system is cached as a tarball, the image in the engine: later runs reuse both.
#
# Exit status: 0 ready; 77 this machine cannot (the reason on stderr, a line
# starting with SKIP:); anything else is a failure. Idempotent; needs root.
set -euo pipefail

BASE_IMAGE=${OMNI_BASE_IMAGE:-omni-serving-base:bookworm}
CACHE=${OMNI_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omni-serving/docker}
SUITE=bookworm
# Debian's CLI matches Debian's daemon; a newer CLI earlier on PATH may need plugins (buildx).
DOCKER=/usr/bin/docker

skip() { echo "SKIP: $*" >&2; exit 77; }

[ "$(uname -s)" = Linux ] || skip "not Linux"
[ "$(id -u)" -eq 0 ] || skip "not root: installing packages and starting dockerd need root"
mkdir -p "$CACHE"

# 1) packages
need=()
[ -x /usr/sbin/dockerd ] && [ -x "$DOCKER" ] || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || skip "no apt-get to install ${need[*]}"
  timeout 180 apt-get update -qq >"$CACHE/apt.log" 2>&1 \
    || skip "apt-get update failed (no Debian mirror?): $(tail -n 2 "$CACHE/apt.log")"
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
    "${need[@]}" >>"$CACHE/apt.log" 2>&1 \
    || skip "apt-get install ${need[*]} failed: $(tail -n 2 "$CACHE/apt.log")"
fi

# 2) the daemon
if ! "$DOCKER" info >/dev/null 2>&1; then
  if pgrep -x dockerd >/dev/null 2>&1; then
    : # starting, or stuck: wait below
  else
    nohup /usr/sbin/dockerd >"$CACHE/dockerd.log" 2>&1 </dev/null &
  fi
  for _ in $(seq 1 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    sleep 1
  done
  "$DOCKER" info >/dev/null 2>&1 \
    || skip "dockerd does not answer after 60 s: $(tail -n 3 "$CACHE/dockerd.log" 2>/dev/null)"
fi

# 3) the base image
if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  tarball="$CACHE/$SUITE-rootfs.tar"
  if [ ! -s "$tarball" ]; then
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    timeout 600 debootstrap --variant=minbase \
      --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates,libnuma1 \
      "$SUITE" "$rootfs" >"$CACHE/debootstrap.log" 2>&1 \
      || skip "debootstrap $SUITE failed: $(tail -n 2 "$CACHE/debootstrap.log")"
    # pip inside the build reaches the package index through the same CAs as this host.
    if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
      cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . >"$tarball.tmp"
    mv "$tarball.tmp" "$tarball"
  fi
  "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'CMD ["python3"]' \
    "$tarball" "$BASE_IMAGE" >/dev/null
fi
echo "$BASE_IMAGE"
