#!/usr/bin/env bash
# The certificates of a trainwarden etcd: a CA, the server's certificate (also for its peers) and one client
# certificate per etcd user. etcd started with --client-cert-auth takes a client's user from its certificate's
# common name, so no password is needed anywhere (roles.sh makes the users and their roles).
#
#   deploy/etcd/make-certs.sh DIR NAME...     NAME: each DNS name and IP address the etcd members answer on
#
# DIR gets ca.pem and ca-key.pem (keep the key offline once done), server.pem/server-key.pem for the members,
# and <user>.pem/<user>-key.pem for root (roles.sh, administration), trainwarden-agent (node agents and job
# launchers), trainwarden-submitter (submit, stop, resume) and trainwarden-reader (jobs, nodes, status,
# dashboards). Existing files are kept: run it again to add what is missing. DAYS (default 825) sets validity.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 DIR NAME... (the DNS names and IP addresses of the etcd members)" >&2
    exit 2
fi
command -v openssl >/dev/null || { echo "$0: openssl is needed" >&2; exit 2; }
dir=$1
shift
days=${DAYS:-825}
mkdir -p "$dir"
cd "$dir"
umask 077

if [ ! -f ca.pem ]; then
    openssl req -x509 -newkey rsa:3072 -nodes -days "$days" -subj "/CN=trainwarden-etcd-ca" \
        -keyout ca-key.pem -out ca.pem 2>/dev/null
    echo "made ca.pem"
fi

issue() {  # issue NAME CN EXTENSIONS
    local name=$1 cn=$2 ext=$3
    [ -f "$name.pem" ] && return 0
    openssl req -newkey rsa:3072 -nodes -subj "/CN=$cn" -keyout "$name-key.pem" -out "$name.csr" 2>/dev/null
    printf '%b\n' "$ext" > "$name.ext"
    openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days "$days" \
        -extfile "$name.ext" -out "$name.pem" 2>/dev/null
    rm -f "$name.csr" "$name.ext"
    echo "made $name.pem (CN=$cn)"
}

san=""
for name in "$@"; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
done
issue server etcd-server "subjectAltName=${san%,}\nextendedKeyUsage=serverAuth,clientAuth"
for user in root trainwarden-agent trainwarden-submitter trainwarden-reader; do
    issue "$user" "$user" "extendedKeyUsage=clientAuth"
done
chmod 0644 ca.pem ./*.pem
chmod 0600 ./*-key.pem
