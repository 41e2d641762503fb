#!/usr/bin/env bash
# Install Debian's PostgreSQL if needed, start a throwaway cluster on 127.0.0.1:55432 and print
# its SQLAlchemy URL. Idempotent: a running cluster is reused.
set -euo pipefail
PORT=55432
DATA=/tmp/agentspec-pg
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) >&2
fi
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
id postgres >/dev/null 2>&1 || useradd -r postgres
if ! su postgres -c "$BIN/pg_ctl -D $DATA status" >/dev/null 2>&1; then
  rm -rf "$DATA"; mkdir -p "$DATA"; chown postgres "$DATA"
  su postgres -c "$BIN/initdb -D $DATA -A trust -U postgres" >/dev/null
  su postgres -c "$BIN/pg_ctl -D $DATA -l $DATA/log -o '-p $PORT -k /tmp -c listen_addresses=127.0.0.1' -w start" >/dev/null
fi
psql -h 127.0.0.1 -p $PORT -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='agentspec_test'" | grep -q 1 \
  || psql -h 127.0.0.1 -p $PORT -U postgres -c "CREATE DATABASE agentspec_test" >/dev/null
echo "postgresql+psycopg://postgres@127.0.0.1:$PORT/agentspec_test"
