#!/usr/bin/env bash
# Build and install pgvector (the `vector` extension knowledge search needs) into each local
# PostgreSQL server that lacks it. Debian 12 packages no pgvector, so this takes the source of
# Debian's own package (the next release's, checked by apt against its signed index), builds it
# against the server's headers (postgresql-server-dev-N) and installs it. Needs root or sudo.
set -euo pipefail
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
sources=/etc/apt/sources.list.d/loopline-pgvector-src.sources
for pg_config in /usr/lib/postgresql/*/bin/pg_config; do
  [ -x "$pg_config" ] || continue
  [ -f "$("$pg_config" --sharedir)/extension/vector.control" ] && continue
  major=$("$pg_config" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
  echo "pgvector: building the vector extension for PostgreSQL $major"
  $sudo apt-get install -y -qq "postgresql-server-dev-$major" >/dev/null
  work=$(mktemp -d)
  trap '$sudo rm -f "$sources"; rm -rf "$work"' EXIT
  printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    | $sudo tee "$sources" >/dev/null
  $sudo apt-get update -qq >/dev/null
  (cd "$work" && apt-get source --download-only -qq pgvector >/dev/null 2>&1)
  tar -xzf "$work"/pgvector_*.orig.tar.gz -C "$work"
  make -s -C "$work"/pgvector-*/ PG_CONFIG="$pg_config" OPTFLAGS="" >/dev/null
  $sudo make -s -C "$work"/pgvector-*/ PG_CONFIG="$pg_config" install >/dev/null
done
