#!/usr/bin/env bash
# trainwarden's etcd users and roles, then authentication on. Run once against an etcd started with TLS and
# --client-cert-auth --trusted-ca-file DIR/ca.pem (make-certs.sh made DIR); each user is its certificate's CN.
#
#   deploy/etcd/roles.sh ENDPOINT DIR [PREFIX]     e.g. https://10.0.0.5:2379 /etc/trainwarden/etcd-certs
#
# Roles, on the keys under PREFIX (default /trainwarden/v1):
#   trainwarden-agent      read and write everything: node agents (their node records, incidents, the jobs they
#                          run) and job launchers (`trainwarden run`: rendezvous, job state, checkpoint commits).
#                          Also what `trainwarden cordon/drain/uncordon` need.
#   trainwarden-submitter  read everything, write jobs/ (submit, stop, resume). Not rdzv/: torch's rendezvous
#                          state there is pickled, and every launcher of the job unpickles it.
#   trainwarden-reader     read everything (`jobs`, `nodes`, `status --etcd`, `incidents --etcd`, dashboards).
# Nothing outside PREFIX is granted. Running it again adds what is missing.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 ENDPOINT CERT_DIR [PREFIX]" >&2
    exit 2
fi
endpoint=$1
dir=$2
prefix=${3:-/trainwarden/v1}
prefix=${prefix%/}
etcdctl=${ETCDCTL:-etcdctl}

ctl() {
    "$etcdctl" --endpoints "$endpoint" --cacert "$dir/ca.pem" --cert "$dir/root.pem" --key "$dir/root-key.pem" \
        --dial-timeout 5s --command-timeout 10s "$@"
}

quietly() {  # a step that may have been done by an earlier run
    local out
    if ! out=$(ctl "$@" 2>&1); then
        case $out in
            *"already exists"*|*"already granted"*) ;;
            *) echo "$0: etcdctl $*: $out" >&2; exit 1 ;;
        esac
    fi
}

quietly user add root --no-password
quietly user grant-role root root
quietly role add trainwarden-agent
quietly role grant-permission trainwarden-agent --prefix=true readwrite "$prefix/"
quietly role add trainwarden-submitter
quietly role grant-permission trainwarden-submitter --prefix=true read "$prefix/"
quietly role grant-permission trainwarden-submitter --prefix=true readwrite "$prefix/jobs/"
quietly role add trainwarden-reader
quietly role grant-permission trainwarden-reader --prefix=true read "$prefix/"
for who in agent submitter reader; do
    quietly user add "trainwarden-$who" --no-password
    quietly user grant-role "trainwarden-$who" "trainwarden-$who"
done
quietly auth enable
echo "etcd at $endpoint: users root, trainwarden-agent, trainwarden-submitter, trainwarden-reader; auth enabled"
