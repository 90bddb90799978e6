#!/usr/bin/env bash
# Starts (or stops) the peers the benchmark compares oncegate with, from Debian's
# packages, each with its own configuration in a temporary directory, on loopback only:
#
#   Redis 7 on 127.0.0.1:6390 with appendonly yes, appendfsync always (durable like
#   oncegate's synchronous=FULL);
#   PostgreSQL 15 on 127.0.0.1:5440 with fsync on and synchronous_commit on.
#
# Usage: peers.sh start | stop | status. Installs the packages if they are missing.
# State (data, logs, PIDs) lives under ${ONCEGATE_PEERS_DIR:-/tmp/oncegate-peers}.
set -euo pipefail

dir=${ONCEGATE_PEERS_DIR:-/tmp/oncegate-peers}
redis_port=6390
pg_port=5440

pg_bin() {
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "$bin" ] || { echo "no PostgreSQL server binaries found" >&2; exit 1; }
  echo "$bin"
}

install_missing() {
  local want=()
  command -v redis-server >/dev/null 2>&1 || want+=(redis-server)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || want+=(postgresql)
  if [ ${#want[@]} -gt 0 ]; then
    echo "installing ${want[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}" >/dev/null
  fi
}

start() {
  install_missing
  mkdir -p "$dir/redis" "$dir/pg"
  cat > "$dir/redis/redis.conf" <<CONF
bind 127.0.0.1
port $redis_port
protected-mode yes
daemonize yes
pidfile $dir/redis/redis.pid
logfile $dir/redis/redis.log
dir $dir/redis
appendonly yes
appendfsync always
save ""
CONF
  redis-server "$dir/redis/redis.conf"

  local bin
  bin=$(pg_bin)
  chown -R postgres:postgres "$dir/pg" 2>/dev/null || true
  if [ ! -f "$dir/pg/data/PG_VERSION" ]; then
    runuser -u postgres -- "$bin/initdb" -D "$dir/pg/data" -A trust -U postgres >/dev/null
  fi
  runuser -u postgres -- "$bin/pg_ctl" -D "$dir/pg/data" -l "$dir/pg/pg.log" -w start \
    -o "-p $pg_port -k $dir/pg -c listen_addresses=127.0.0.1 -c fsync=on -c synchronous_commit=on -c max_connections=300" >/dev/null
  echo "redis on 127.0.0.1:$redis_port (appendfsync always); postgres on 127.0.0.1:$pg_port (synchronous_commit on)"
}

stop() {
  if [ -f "$dir/redis/redis.pid" ]; then
    kill "$(cat "$dir/redis/redis.pid")" 2>/dev/null || true
    rm -f "$dir/redis/redis.pid"
  fi
  if [ -f "$dir/pg/data/postmaster.pid" ]; then
    runuser -u postgres -- "$(pg_bin)/pg_ctl" -D "$dir/pg/data" -m fast -w stop >/dev/null || true
  fi
  rm -rf "$dir"
  echo "peers stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status)
    [ -f "$dir/redis/redis.pid" ] && echo "redis pid $(cat "$dir/redis/redis.pid")" || echo "redis stopped"
    [ -f "$dir/pg/data/postmaster.pid" ] && echo "postgres pid $(head -n 1 "$dir/pg/data/postmaster.pid")" || echo "postgres stopped"
    ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
