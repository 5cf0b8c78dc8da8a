#!/bin/bash
# The image's HEALTHCHECK: exits 0 when this container's admin endpoint answers 200 on /live.
#
# The runtime image carries no curl: bash's /dev/tcp speaks the one HTTP/1.0 request this needs.
# The admin address is the process's own `admin_listen`, read from CELLMESH_ADMIN_LISTEN as the
# compose files and manifests set it (a wildcard host is asked on loopback); CELLMESH_HEALTH_ADDR
# overrides it. A container that serves no admin endpoint (the arena game, bots) disables the
# check in its compose service.
set -u
addr=${CELLMESH_HEALTH_ADDR:-${CELLMESH_ADMIN_LISTEN:-127.0.0.1:9100}}
port=${addr##*:}
host=${addr%:*}
case $host in
'' | 0.0.0.0 | '[::]' | '::') host=127.0.0.1 ;;
'['*']') host=${host#[} host=${host%]} ;;
esac
exec 3<>"/dev/tcp/$host/$port" || exit 1
printf 'GET /live HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n' "$host" >&3
IFS= read -r -t 2 status <&3 || exit 1
[[ $status == HTTP/1.[01]' 200'* ]]
