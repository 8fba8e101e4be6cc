#!/usr/bin/env bash
# gpu-orphan's release, built by `make release` (which passes VERSION,
# LDFLAGS, BUILD_TAGS and BINARIES, the same as `make build`'s): every
# binary for linux/amd64 and linux/arm64 (Grace Hopper nodes), with cgo
# (go-nvml), -trimpath. In DIST (dist/): one tarball per architecture,
# gpu-orphan-VERSION-linux-ARCH.tar.gz, with the binaries, README.md,
# CHANGELOG.md and the systemd units; and SHA256SUMS.
#
# Then it checks what it built, and fails on the first thing that is wrong:
# each binary's GOOS, GOARCH, CGO_ENABLED and -trimpath as `go version -m`
# reads them; its machine as `file` reads it (x86-64, ARM aarch64); the
# glibc it needs as `objdump -T` reads it (2.34 at most). Each binary runs
# `--version`, exits 0 and prints VERSION (the other architecture's under
# qemu-user: qemu-aarch64 on an amd64 machine). Each tarball holds what it
# should, and `sha256sum -c SHA256SUMS` passes.
#
# The C cross compiler is Debian's (gcc-aarch64-linux-gnu and
# libc6-dev-arm64-cross on an amd64 machine; gcc-x86-64-linux-gnu and
# libc6-dev-amd64-cross on an arm64 one), installed with `file`, binutils
# and qemu-user when missing, as scripts/deps.sh installs its packages.
#
#   scripts/release.sh               the release, as above
#   scripts/release.sh cc ARCH       prints the C compiler that builds for linux/ARCH here
#   scripts/release.sh deps ARCH...  installs the C compilers for ARCH... when missing
#
# deploy/docker/Dockerfile runs `deps` and `cc` for its TARGETARCH, so the
# image and the tarballs choose their compiler the same way.
set -euo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
hostarch=$($GO env GOHOSTARCH)

# triplet ARCH: the GNU triplet of linux/ARCH.
triplet() {
  case "$1" in
    amd64) echo x86_64-linux-gnu ;;
    arm64) echo aarch64-linux-gnu ;;
    *) echo "release: linux/$1 is not a release architecture (amd64, arm64)" >&2; return 1 ;;
  esac
}

# cc_for ARCH: the machine's gcc for its own architecture, Debian's cross
# compiler for the other.
cc_for() {
  local t
  t=$(triplet "$1") || return 1
  if [ "$1" = "$hostarch" ]; then echo gcc; else echo "$t-gcc"; fi
}

# qemu_for ARCH: qemu-user's emulator for linux/ARCH.
qemu_for() { echo "qemu-$(triplet "$1" | cut -d- -f1)"; }

# cc_works CC: CC runs and finds the C library's headers.
cc_works() {
  command -v "$1" >/dev/null && echo '#include <stdlib.h>' | "$1" -x c -E - >/dev/null 2>&1
}

# install_missing ARCH...: the C compilers for ARCH... (and, with
# RELEASE_CHECKS=1, what the checks need: `file` and qemu-user), from
# Debian, noninteractive.
install_missing() {
  local arch t missing=()
  for arch in "$@"; do
    t=$(triplet "$arch")
    cc_works "$(cc_for "$arch")" && continue
    if [ "$arch" = "$hostarch" ]; then
      missing+=(gcc libc6-dev)
    else
      # Debian names the packages gcc-x86-64-linux-gnu, libc6-dev-amd64-cross.
      missing+=("gcc-${t//_/-}" "libc6-dev-$arch-cross")
    fi
  done
  if [ "${RELEASE_CHECKS:-0}" = 1 ]; then
    command -v file >/dev/null || missing+=(file)
    command -v objdump >/dev/null || missing+=(binutils)
    # qemu-user runs the other architecture's binaries (qemu-aarch64,
    # qemu-x86_64): 12 MB, a few seconds to install.
    for arch in "$@"; do
      [ "$arch" = "$hostarch" ] || command -v "$(qemu_for "$arch")" >/dev/null || missing+=(qemu-user)
    done
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "release: installing ${missing[*]} (Debian packages)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  for arch in "$@"; do
    cc_works "$(cc_for "$arch")" || { echo "release: $(cc_for "$arch") does not work after the install" >&2; return 1; }
  done
}

case "${1:-}" in
  cc)
    [ $# -eq 2 ] || { echo "usage: $0 cc ARCH" >&2; exit 2; }
    cc_for "$2"
    exit 0
    ;;
  deps)
    shift
    [ $# -ge 1 ] || { echo "usage: $0 deps ARCH..." >&2; exit 2; }
    install_missing "$@"
    exit 0
    ;;
  "") ;;
  *) echo "usage: $0 [cc ARCH | deps ARCH...]" >&2; exit 2 ;;
esac

: "${VERSION:?VERSION is not set: run make release}"
: "${LDFLAGS:?LDFLAGS is not set: run make release}"
: "${BINARIES:?BINARIES is not set: run make release}"
dist=${DIST:-dist}
# The binaries run on glibc 2.34 or later (Debian 12, Ubuntu 22.04, RHEL 9);
# a build that needs a newer one fails.
max_glibc=${RELEASE_MAX_GLIBC:-2.34}
arches=${RELEASE_ARCHES:-amd64 arm64}
read -r -a binaries <<<"$BINARIES"
pkgs=()
for b in "${binaries[@]}"; do
  [ -d "cmd/$b" ] || { echo "release: BINARIES names $b, but there is no cmd/$b" >&2; exit 1; }
  pkgs+=("./cmd/$b")
done

# shellcheck disable=SC2086 # one word per architecture
RELEASE_CHECKS=1 install_missing $arches

fail() { echo "release: FAIL: $*" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$dist"
mkdir -p "$dist"
# The tarballs' files carry the commit's time, and no user or group.
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
docs=(README.md CHANGELOG.md)
[ -f LICENSE ] && docs+=(LICENSE)

for arch in $arches; do
  t=$(triplet "$arch")
  cc=$(cc_for "$arch")
  name=gpu-orphan-$VERSION-linux-$arch
  dir=$work/$name
  mkdir -p "$dir/systemd"
  echo "release: linux/$arch with $cc"
  CGO_ENABLED=1 GOOS=linux GOARCH=$arch CC=$cc \
    $GO build -trimpath ${BUILD_TAGS:+-tags "$BUILD_TAGS"} -ldflags "$LDFLAGS" -o "$dir/" "${pkgs[@]}"

  case "$arch" in
    amd64) machine='ELF 64-bit LSB .*x86-64' ;;
    arm64) machine='ELF 64-bit LSB .*ARM aarch64' ;;
  esac
  qemu=$(qemu_for "$arch")
  for b in "${binaries[@]}"; do
    bin=$dir/$b
    meta=$($GO version -m "$bin") || fail "$b ($arch): go version -m: $?"
    for want in GOOS=linux "GOARCH=$arch" CGO_ENABLED=1 -trimpath=true; do
      grep -qx "	build	$want" <<<"$meta" || fail "$b ($arch): go version -m has no 'build $want':
$meta"
    done
    desc=$(file -b "$bin")
    grep -q "$machine" <<<"$desc" || fail "$b ($arch): file says '$desc', not /$machine/"
    # The newest glibc symbol version it needs: the oldest glibc it runs on.
    glibc=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
    glibc=${glibc#GLIBC_}
    [ -n "$glibc" ] || fail "$b ($arch): objdump -T shows no GLIBC_ symbol versions"
    [ "$(printf '%s\n' "$glibc" "$max_glibc" | sort -V | tail -1)" = "$max_glibc" ] ||
      fail "$b ($arch) needs glibc $glibc, newer than $max_glibc (RELEASE_MAX_GLIBC; docs/release.md)"
    if [ "$arch" = "$hostarch" ]; then
      run=("$bin" --version)
    elif command -v "$qemu" >/dev/null; then
      run=("$qemu" -L "/usr/$t" "$bin" --version)
    else
      run=()
    fi
    ran="--version not run (no $qemu)"
    if [ ${#run[@]} -gt 0 ]; then
      out=$("${run[@]}" 2>&1) || fail "$b ($arch): ${run[*]} exited $?:
$out"
      grep -q "version $VERSION " <<<"$out" || fail "$b ($arch): --version does not print version $VERSION:
$out"
      ran="--version: $(head -1 <<<"$out")"
    fi
    echo "  $b: GOARCH=$arch CGO_ENABLED=1; $(cut -d, -f1-2 <<<"$desc"); glibc >= $glibc; $ran"
  done

  cp "${docs[@]}" "$dir/"
  cp deploy/systemd/*.service deploy/systemd/*.default "$dir/systemd/"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" -C "$work" -cf - "$name" |
    gzip -n >"$dist/$name.tar.gz"
  listed=$(tar -tzf "$dist/$name.tar.gz")
  for f in "${binaries[@]}" "${docs[@]}"; do
    grep -qx "$name/$f" <<<"$listed" || fail "$dist/$name.tar.gz lacks $name/$f"
  done
done

(cd "$dist" && sha256sum -- *.tar.gz >SHA256SUMS && sha256sum -c SHA256SUMS) || fail "sha256sum -c $dist/SHA256SUMS"
ls -l "$dist"
