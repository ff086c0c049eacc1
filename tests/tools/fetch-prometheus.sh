#!/usr/bin/env bash
# Debian's prometheus package, unpacked under .cache/prometheus (prometheus and promtool, no
# system install); a no-op when it is there. The Prometheus test uses it; .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.cache/prometheus
[ -x "$dest/usr/bin/prometheus" ] && [ -x "$dest/usr/bin/promtool" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download prometheus >/dev/null 2>&1) || {
    (apt-get update >/dev/null 2>&1 || true) && (cd "$tmp" && apt-get download prometheus >/dev/null)
}
mkdir -p "$dest"
dpkg -x "$tmp"/prometheus_*.deb "$dest"
"$dest/usr/bin/prometheus" --version >/dev/null
echo "prometheus: $dest/usr/bin/prometheus"
