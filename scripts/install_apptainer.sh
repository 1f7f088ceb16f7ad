#!/usr/bin/env bash
# Install Apptainer for nemo-gym-prorl into a private prefix inside the repo (.apptainer/), and the Debian
# packages the sandbox images need (mmdebstrap, squashfs-tools, ...). Prints the path of the `apptainer` binary.
#
# Debian 12 has no apptainer package; Debian sid has one that needs a newer glibc (DESIGN.md §3). So: fetch the sid
# `apptainer` and `libc6` debs with a private apt configuration (own sources list, lists and cache dirs) built from
# the host's configured Debian mirror, unpack both into the prefix, point the `apptainer` and `starter` binaries at
# that libc with patchelf, and write the relocated config (`systemd cgroups = no`, shared loop devices) and state
# dirs. The host's apt sources are only read, never changed. A second run finds the stamp and does nothing.
#
# Environment: PRORL_APPTAINER_PREFIX overrides the prefix (default: <repo>/.apptainer). Next to the prefix the
# script keeps a lock file (<prefix>.lock) and, while it works, a stage dir (<prefix>.tmp.<pid>).
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX="${PRORL_APPTAINER_PREFIX:-$PWD/.apptainer}"
BIN="$PREFIX/usr/bin/apptainer"
STAMP="$PREFIX/.prorl-installed"
SUITE=sid
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

log() { echo "install_apptainer: $*" >&2; }
die() { log "error: $*"; exit 1; }

# -- 1. Debian packages from the host's normal apt configuration -----------------------------------------------
need_apt=()
for tool in patchelf:patchelf mksquashfs:squashfs-tools unsquashfs:squashfs-tools mmdebstrap:mmdebstrap \
  squashfuse:squashfuse fuse2fs:fuse2fs prlimit:util-linux setpriv:util-linux; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_apt+=("${tool#*:}")
done
for pkg in libseccomp2 libsqlite3-0 debian-archive-keyring ca-certificates; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  mapfile -t need_apt < <(printf '%s\n' "${need_apt[@]}" | sort -u)
  log "installing Debian packages: ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

fingerprint=$(sha256sum "$0" | cut -d' ' -f1)
installed() { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] && "$BIN" version >/dev/null 2>&1; }
if installed; then
  echo "$BIN"
  exit 0
fi
# One installer at a time (two test sessions may start together); the winner's install serves both.
mkdir -p "$(dirname "$PREFIX")"
exec 9>"$PREFIX.lock"
flock 9
if installed; then
  echo "$BIN"
  exit 0
fi

# -- 2. the sid debs, through a private apt configuration ------------------------------------------------------
# shellcheck disable=SC1091
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$codename" ] || die "/etc/os-release names no VERSION_CODENAME; is this Debian?"
# The host's mirror: the repository its apt sources use for the release itself (not -updates/-security).
mirror=$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Identifier: Packages' |
  awk -v c="$codename" '$1 == c { print $2; exit }')
[ -n "$mirror" ] || die "no apt source for '$codename' is configured (see /etc/apt/sources.list.d/)"
[ -f "$KEYRING" ] || die "$KEYRING is missing (package debian-archive-keyring)"

STAGE="$PREFIX.tmp.$$"
trap 'rm -rf "$STAGE"' EXIT
rm -rf "$STAGE"
APT="$STAGE/apt"
mkdir -p "$APT"/{lists/partial,archives/partial,cache,parts,prefs,debs}
echo "deb [signed-by=$KEYRING] $mirror $SUITE main" >"$APT/sources.list"
: >"$APT/status"
apt_opts=(
  -o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=$APT/parts"
  -o "Dir::Etc::Preferences=$APT/prefs/none" -o "Dir::Etc::PreferencesParts=$APT/prefs"
  -o "Dir::State::Lists=$APT/lists" -o "Dir::State::Status=$APT/status"
  -o "Dir::Cache=$APT/cache" -o "Dir::Cache::Archives=$APT/archives"
  -o "Acquire::Check-Valid-Until=false" -o "APT::Sandbox::User=root"
)
log "fetching apptainer and libc6 from $SUITE ($mirror)"
apt-get "${apt_opts[@]}" -qq update
(cd "$APT/debs" && apt-get "${apt_opts[@]}" -qq download apptainer libc6)

# -- 3. unpack, relocate, configure ----------------------------------------------------------------------------
ROOT="$STAGE/root"
mkdir -p "$ROOT"
for deb in "$APT"/debs/*.deb; do dpkg-deb -x "$deb" "$ROOT"; done

loader=$(cd "$ROOT" && find usr/lib -name 'ld-linux*.so.[0-9]' -type f | head -n1)
[ -n "$loader" ] || die "no dynamic loader in the libc6 deb"
libdir=$(dirname "$loader")
starter=$(cd "$ROOT" && find usr/lib -path '*/apptainer/bin/starter' -type f | head -n1)
[ -n "$starter" ] || die "no starter binary in the apptainer deb"
for bin in usr/bin/apptainer "$starter"; do
  # Paths are those the files will have once the stage is moved into place.
  patchelf --set-interpreter "$PREFIX/$loader" --set-rpath "$PREFIX/$libdir" "$ROOT/$bin"
done

# Relocated, apptainer and its starter look for config under <prefix>/usr/etc and <prefix>/usr/lib/etc and for
# state under <prefix>/usr/var/lib/apptainer and <prefix>/usr/lib/var/lib/apptainer: one copy, two names.
# cgroups through systemd are not available here.
mkdir -p "$ROOT/usr/etc" "$ROOT/usr/var/lib"
mv "$ROOT/etc/apptainer" "$ROOT/usr/etc/apptainer"
mv "$ROOT/var/lib/apptainer" "$ROOT/usr/var/lib/apptainer"
ln -s ../etc "$ROOT/usr/lib/etc"
ln -s ../var "$ROOT/usr/lib/var"
rm -rf "$ROOT/var" "$ROOT/usr/share/doc" "$ROOT/usr/share/man"
conf="$ROOT/usr/etc/apptainer/apptainer.conf"
# Loop devices: every instance of one SIF shares one (without this, each instance mounts its SIF on a loop device of
# its own), and Apptainer looks beyond the first 256 (bwrap sandboxes' disks hold one each, from the lowest free).
for setting in 'systemd cgroups = no' 'shared loop devices = yes' 'max loop devices = 8192'; do
  key=${setting% = *}
  sed -i -E "s/^#?[[:space:]]*$key[[:space:]]*=.*/$setting/" "$conf"
  grep -qx "$setting" "$conf" || echo "$setting" >>"$conf"
done

rm -rf "$PREFIX"
mv -T "$ROOT" "$PREFIX"
"$BIN" version >/dev/null || die "the installed apptainer does not run: $BIN"
for key in APPTAINER_CONFDIR SESSIONDIR; do
  dir=$("$BIN" buildcfg | sed -n "s/^$key=//p")
  [ -d "$dir" ] || die "apptainer expects $key at $dir, which the install did not create"
done
echo "$fingerprint" >"$STAMP"
log "installed apptainer $("$BIN" version) in $PREFIX"
echo "$BIN"
