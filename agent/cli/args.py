"""Arguments shared by the commands: a job name (the one rule), a positive number of seconds, a count, and
etcd's TLS/auth flags."""

from __future__ import annotations

import argparse

from trainwarden.agent.proto.contract import validate_job_name, validate_node_name

__all__ = ["add_etcd_security", "etcd_security", "job_name", "positive_float", "positive_int"]


def job_name(text: str) -> str:
    """A job name by the one rule (agent/proto/contract.py); argparse says what is wrong and exits 2."""
    try:
        return validate_job_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def node_name(text: str) -> str:
    """A node name (agent/proto/contract.py); argparse says what is wrong and exits 2."""
    try:
        return validate_node_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def add_etcd_security(p: argparse.ArgumentParser) -> None:
    """``--etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file`` (defaults: TRAINWARDEN_ETCD_*)."""
    group = p.add_argument_group("etcd TLS and authentication (for --etcd; each defaults to its TRAINWARDEN_ETCD_* "
                                 "variable)")
    group.add_argument("--etcd-ca", metavar="PEM", dest="etcd_ca",
                       help="CA bundle that signed etcd's certificate (turns TLS on; $TRAINWARDEN_ETCD_CA)")
    group.add_argument("--etcd-cert", metavar="PEM", dest="etcd_cert",
                       help="client certificate for mutual TLS, with --etcd-key ($TRAINWARDEN_ETCD_CERT)")
    group.add_argument("--etcd-key", metavar="PEM", dest="etcd_key",
                       help="client private key for mutual TLS ($TRAINWARDEN_ETCD_KEY)")
    group.add_argument("--etcd-user", metavar="NAME", dest="etcd_user", help="etcd user ($TRAINWARDEN_ETCD_USER)")
    group.add_argument("--etcd-password-file", metavar="FILE", dest="etcd_password_file",
                       help="file holding the user's password; never the password itself, which ps would show "
                            "($TRAINWARDEN_ETCD_PASSWORD_FILE)")


def etcd_security(args: argparse.Namespace):
    """The ``EtcdSecurity`` the flags (and the environment) give; ValueError saying what is wrong."""
    from trainwarden.agent.etcd.client import EtcdSecurity

    return EtcdSecurity.from_env(ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key,
                                 user=args.etcd_user, password_file=args.etcd_password_file)
