"""Arguments shared by the commands: a job name (the one rule), a positive number of seconds, a count, and
etcd's TLS/auth flags with the connection they make (``connect_etcd``)."""

from __future__ import annotations

import argparse

from trainwarden.agent.shared.contract import validate_job_name, validate_node_name

__all__ = ["EtcdCommandError", "add_etcd_security", "connect_etcd", "etcd_security", "job_name", "positive_float",
           "positive_int"]


def job_name(text: str) -> str:
    """A job name by the one rule (agent/shared/contract.py); argparse says what is wrong and exits 2."""
    try:
        return validate_job_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def node_name(text: str) -> str:
    """A node name (agent/shared/contract.py); argparse says what is wrong and exits 2."""
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


def add_etcd_security(p: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """``--etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file`` (defaults: TRAINWARDEN_ETCD_*).
    ``suppress``: on a sub-command's parser, so that flags given before the sub-command are kept."""
    default = argparse.SUPPRESS if suppress else None
    group = p.add_argument_group("etcd TLS and authentication (for --etcd; each defaults to its TRAINWARDEN_ETCD_* "
                                 "variable)")
    group.add_argument("--etcd-ca", metavar="PEM", dest="etcd_ca", default=default,
                       help="CA bundle that signed etcd's certificate (turns TLS on; $TRAINWARDEN_ETCD_CA)")
    group.add_argument("--etcd-cert", metavar="PEM", dest="etcd_cert", default=default,
                       help="client certificate for mutual TLS, with --etcd-key ($TRAINWARDEN_ETCD_CERT)")
    group.add_argument("--etcd-key", metavar="PEM", dest="etcd_key", default=default,
                       help="client private key for mutual TLS ($TRAINWARDEN_ETCD_KEY)")
    group.add_argument("--etcd-user", metavar="NAME", dest="etcd_user", default=default,
                       help="etcd user ($TRAINWARDEN_ETCD_USER)")
    group.add_argument("--etcd-password-file", metavar="FILE", dest="etcd_password_file", default=default,
                       help="file holding the user's password; never the password itself, which ps would show "
                            "($TRAINWARDEN_ETCD_PASSWORD_FILE)")
    group.add_argument("--insecure-etcd", action="store_true", dest="insecure_etcd", default=default,
                       help="allow plain http to an etcd that is not on loopback (refused otherwise: whoever can "
                            "reach it could write jobs; $TRAINWARDEN_INSECURE_ETCD=1)")


def etcd_security(args: argparse.Namespace):
    """The ``EtcdSecurity`` the flags (and the environment) give; ValueError saying what is wrong."""
    from trainwarden.agent.etcd.client import EtcdSecurity

    return EtcdSecurity.from_env(ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key,
                                 user=args.etcd_user, password_file=args.etcd_password_file,
                                 insecure=getattr(args, "insecure_etcd", None))


class EtcdCommandError(Exception):
    """etcd cannot serve a command: a one-line message and the exit code (``EXIT_USAGE`` for bad flags,
    ``EXIT_ETCD_UNAVAILABLE`` when it does not answer or refuses the credentials)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def connect_etcd(args: argparse.Namespace):
    """A client of ``args.etcd`` (``host:port[,host:port...]``) with the TLS/auth flags, checked to answer;
    ``EtcdCommandError`` otherwise. The caller closes it."""
    from trainwarden.agent.common import exit_codes
    from trainwarden.agent.etcd.job_records import EtcdAccessDenied, EtcdUnavailable, connect

    try:
        members = tuple(e.strip() for e in args.etcd.split(",") if e.strip())
        return connect(etcd_security(args).config(members, timeout=5.0, connect_timeout=2.0))
    except ValueError as exc:
        raise EtcdCommandError(str(exc), exit_codes.EXIT_USAGE) from None
    except (EtcdUnavailable, EtcdAccessDenied) as exc:
        raise EtcdCommandError(str(exc), exit_codes.EXIT_ETCD_UNAVAILABLE) from None
