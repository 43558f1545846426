#!/bin/sh
# Installs the Debian packages named on the command line that are missing:
# apt-get update once, then apt-get install; sudo when not root. Quick
# (one dpkg-query) when everything is there.
missing=
for p in "$@"; do
	dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "make deps: installing$missing"
if [ "$(id -u)" -ne 0 ]; then
	command -v sudo >/dev/null || { echo "make deps: not root and no sudo; install$missing by hand" >&2; exit 1; }
	SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || exit 1
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null || exit 1
