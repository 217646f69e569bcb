"""`trainwarden agent`: its arguments and configuration; the daemon itself is ``trainwarden.agent.node.daemon``.

Settings come from, in order of precedence: the command-line flags, ``TRAINWARDEN_<KEY>`` environment variables
(``TRAINWARDEN_NODE``, ``TRAINWARDEN_METRICS_PORT``, ``TRAINWARDEN_ETCD``, ...), the TOML file named by ``--config``
(keys as the flags, with underscores: ``metrics_port = 9478``), and the built-in defaults. An unknown key or a
value of the wrong type in the file or the environment is an error that names the key and where it came from.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping

from trainwarden.agent.cli.args import add_etcd_security
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.launch_options import LAUNCH_OPTIONS

__all__ = ["SETTINGS", "add_parser", "resolve_settings"]

SETTINGS: dict[str, tuple[type, Any]] = {
    "socket": (str, "/run/trainwarden/agent.sock"),  # agent/node/endpoints.py DEFAULT_SOCKET
    "metrics_host": (str, "0.0.0.0"),
    "metrics_port": (int, 9478),
    "health_host": (str, "127.0.0.1"),
    "health_port": (int, None),
    "node": (str, None),
    "state_home": (str, None),
    "etcd": (str, None),
    "etcd_ca": (str, None),
    "etcd_cert": (str, None),
    "etcd_key": (str, None),
    "etcd_user": (str, None),
    "etcd_password_file": (str, None),
    "etcd_admin_user": (str, None),
    "etcd_admin_password_file": (str, None),
    **{option.setting: (option.kind, option.default) for option in LAUNCH_OPTIONS if option.setting},
    "local_addr": (str, None),
    "run_jobs": (bool, True),
    "webhook_listen": (str, None),
    "webhook_token_file": (str, None),
    "webhook_tls_cert": (str, None),
    "webhook_tls_key": (str, None),
    "webhook_max_body": (int, 256 * 1024),
    "resumes_per_hour": (int, 3),
    "allow_unverified_streams": (bool, False),
    "telemetry_hello_timeout_s": (float, 5.0),
    "telemetry_max_streams_per_uid": (int, 64),
    "insecure_etcd": (bool, False),
    "job_user": (str, None),
    "allow_root_jobs": (bool, False),
    "job_users": (str, None),
    "job_groups": (str, None),
    "privileged_groups": (str, "docker,disk,lxd,sudo,wheel,adm,root"),
}
"""Every setting: its type and default (the flag of each is ``--`` and the key with dashes). The launch options
that are settings too (``straggler_policy``, ``hang_floor``) come from their one declaration
(agent/common/launch_options.py), with its type, default, help and check."""
SETTING_OPTIONS = {option.setting: option for option in LAUNCH_OPTIONS if option.setting}


def add_parser(sub) -> None:
    from trainwarden.agent.node.endpoints import DEFAULT_SOCKET

    p = sub.add_parser("agent", help="run the node daemon: telemetry socket, metrics, watchdog, and the submitted "
                                     "jobs that target this node",
                       description="Run the node daemon until SIGTERM/SIGINT: workers stream telemetry to --socket, "
                                   "Prometheus scrapes --metrics-host:--metrics-port, the watchdog handles hangs. "
                                   "With --etcd it also registers the node (nodes/NODE) and starts this node's part "
                                   "of every submitted job that targets it; the jobs outlive the daemon, and a "
                                   "restarted daemon adopts them.",
                       epilog="Settings: flags > TRAINWARDEN_<KEY> variables > --config FILE (TOML, keys as the "
                              "flags with underscores) > defaults.")
    p.add_argument("--config", metavar="FILE", help="TOML file of settings (e.g. deploy/systemd/agent.toml)")
    p.add_argument("--socket", metavar="PATH", help=f"telemetry unix socket (default {DEFAULT_SOCKET})")
    p.add_argument("--metrics-host", metavar="ADDR", help="address of the Prometheus endpoint (default 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="port of the Prometheus endpoint (default 9478; 0: any free port)")
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="serve the standard gRPC health check (grpc.health.v1.Health/Check, nothing else) on this "
                        "TCP port too, for Kubernetes' grpc probes (default: off; 0: any free port)")
    p.add_argument("--health-host", metavar="ADDR", help="address of the --health-port check (default 127.0.0.1; "
                   "0.0.0.0 in a pod, where kubelet probes the pod's IP)")
    p.add_argument("--node", metavar="NAME", help="this node's name in metrics, incidents and jobs (default: host "
                   "name)")
    p.add_argument("--state-home", metavar="DIR", help="root of state directories (incidents, diagnostics, the "
                   "daemon's launcher records and job logs)")
    p.add_argument("--etcd", metavar="URL", help="the cluster's etcd (host:port or http[s]://host:port; several "
                   "members separated by commas): incidents, the node record, submitted jobs")
    p.add_argument("--etcd-admin-user", metavar="NAME",
                   help="an etcd user with the root role: the daemon then gives each job's launcher an etcd user of "
                        "its own, confined to that job's keys, instead of the agents' credential (docs/SECURITY.md)")
    p.add_argument("--etcd-admin-password-file", metavar="FILE",
                   help="the password of --etcd-admin-user, in a file only the daemon's user reads (mode 0600)")
    p.add_argument("--local-addr", metavar="ADDR", help="the address this node's jobs advertise to their peers "
                   "(default: the interface that routes to etcd)")
    p.add_argument("--no-jobs", dest="run_jobs", action="store_false", default=None,
                   help="with --etcd: do not start submitted jobs on this node (telemetry and incidents only)")
    p.add_argument("--job-user", metavar="USER",
                   help="run submitted jobs whose spec names no `user` as this user (name or uid; a non-root system "
                        "user such as trainwarden-job). A root agent without it refuses such jobs; an agent that is "
                        "not root runs them as itself")
    p.add_argument("--allow-root-jobs", action="store_true", default=None,
                   help="let a submitted job run as root (its `user`, or --job-user); default: refused, since anyone "
                        "who can write the jobs/ keys in etcd would run code as root on this node")
    p.add_argument("--job-users", metavar="USER,...",
                   help="only these users (names or uids, separated by commas) and the members of --job-groups may "
                        "run submitted jobs here (default: any user but root and members of --privileged-groups)")
    p.add_argument("--job-groups", metavar="GROUP,...", help="members of these groups may run submitted jobs here")
    p.add_argument("--privileged-groups", metavar="GROUP,...",
                   help="a member of these groups runs no job here unless --job-users names it (default "
                        "docker,disk,lxd,sudo,wheel,adm,root: as good as root)")
    p.add_argument("--allow-unverified-streams", action="store_true", default=None,
                   help="accept telemetry streams without peer credentials (workers that cannot fetch a token from "
                        "SOCKET.cred, e.g. an older runtime): they stream, are never signalled, and may not take a "
                        "rank of a job whose workers are verified (default: refused; docs/SECURITY.md)")
    p.add_argument("--telemetry-hello-timeout-s", type=float, default=None, metavar="S",
                   help="close a telemetry stream that sends no Hello within S seconds (default 5)")
    p.add_argument("--telemetry-max-streams-per-uid", type=int, default=None, metavar="N",
                   help="telemetry streams one uid may hold at once; more are refused (default 64)")
    for key, option in SETTING_OPTIONS.items():  # None: the flag was not given (the setting's sources decide)
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=option.kind, choices=option.choices or None,
                       metavar=option.metavar, help=option.help)
    w = p.add_argument_group("Alertmanager webhook (alerts resume failed jobs; needs --etcd)")
    w.add_argument("--webhook-listen", metavar="HOST:PORT",
                   help="serve POST /v1/alertmanager here (Alertmanager's webhook_configs url; e.g. 0.0.0.0:9480)")
    w.add_argument("--webhook-token-file", metavar="FILE",
                   help="the bearer token Alertmanager sends (its http_config.authorization.credentials_file); "
                        "required with --webhook-listen")
    w.add_argument("--webhook-tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    w.add_argument("--webhook-tls-key", metavar="FILE", help="the key of --webhook-tls-cert (PEM)")
    w.add_argument("--webhook-max-body", type=int, metavar="BYTES",
                   help="larger requests are refused unread with 413 (default 262144)")
    w.add_argument("--resumes-per-hour", type=int, metavar="N",
                   help="resume one job automatically at most N times in any hour (default 3; 0: never)")
    p.add_argument("--check", action="store_true",
                   help="do not start: exit 0 if an agent serves on --socket, 5 if not (for probes)")
    add_etcd_security(p)
    p.set_defaults(func=_cmd_agent)


def resolve_settings(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Each setting from the flags, the environment, the config file or its default (module docstring);
    ValueError naming the key and its source."""
    from trainwarden.agent.common.job_spec import JobSpecError, read_toml, unknown_key_message

    from_file: dict[str, Any] = {}
    if getattr(args, "config", None):
        try:
            from_file = read_toml(args.config, "agent config")
        except JobSpecError as exc:
            raise ValueError(str(exc)) from None
        for key, value in from_file.items():
            if key not in SETTINGS:
                raise ValueError(unknown_key_message(key, SETTINGS, args.config).replace("field", "key", 1))
            kind = SETTINGS[key][0]
            if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
                raise ValueError(f"{args.config}: key {key!r} must be {_kind_name(kind)}, got {value!r}")
    settings = {}
    for key, (kind, default) in SETTINGS.items():
        flag = getattr(args, key, None)
        variable = f"TRAINWARDEN_{key.upper()}"
        if flag is not None:
            settings[key] = flag
        elif environ.get(variable):
            settings[key] = _from_text(environ[variable], kind, variable)
        elif key in from_file:
            settings[key] = from_file[key]
        else:
            settings[key] = default
    for key, option in SETTING_OPTIONS.items():  # checked as `trainwarden run` and a spec check them
        if (why := option.problem(settings[key])) is not None:
            raise ValueError(f"setting {key!r} {why}")
    return settings


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "a whole number", float: "a number", bool: "true or false"}[kind]


def _from_text(text: str, kind: type, source: str) -> Any:
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{source}={text!r}: must be a whole number") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{source}={text!r}: must be a number") from None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{source}={text!r}: must be true or false")
    return text


def _cmd_agent(args) -> int:
    from pathlib import Path

    from trainwarden.agent.etcd.client import EtcdSecurity
    from trainwarden.agent.node.agent import AgentConfig, watchdog_config
    from trainwarden.agent.node.daemon import DaemonOptions, check, run_daemon
    from trainwarden.agent.node.webhook import WebhookConfig
    try:
        s = resolve_settings(args)
    except ValueError as exc:
        print(f"trainwarden agent: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    socket_path = Path(s["socket"])
    if args.check:
        return check(socket_path)
    try:
        config = AgentConfig(socket_path=socket_path.absolute(), metrics_host=s["metrics_host"],
                             metrics_port=s["metrics_port"], health_host=s["health_host"],
                             health_port=s["health_port"], allow_unverified_streams=s["allow_unverified_streams"],
                             telemetry_hello_timeout_s=s["telemetry_hello_timeout_s"],
                             telemetry_max_streams_per_uid=s["telemetry_max_streams_per_uid"],
                             state_home=Path(s["state_home"]) if s["state_home"] else None,
                             watchdog=watchdog_config(s["straggler_policy"], s["hang_floor"]),
                             **({"node": s["node"]} if s["node"] else {}))
        security = EtcdSecurity.from_env(ca_cert=s["etcd_ca"], cert_cert=s["etcd_cert"], cert_key=s["etcd_key"],
                                         user=s["etcd_user"], password_file=s["etcd_password_file"],
                                         insecure=s["insecure_etcd"])
        webhook = None
        if s["webhook_listen"] or s["webhook_token_file"]:
            if not (s["webhook_listen"] and s["webhook_token_file"]):
                raise ValueError("--webhook-listen and --webhook-token-file go together: the webhook only serves "
                                 "requests that carry the token")
            webhook = WebhookConfig(listen=s["webhook_listen"], token_file=Path(s["webhook_token_file"]),
                                    tls_cert=Path(s["webhook_tls_cert"]) if s["webhook_tls_cert"] else None,
                                    tls_key=Path(s["webhook_tls_key"]) if s["webhook_tls_key"] else None,
                                    max_body=s["webhook_max_body"], resumes_per_hour=s["resumes_per_hour"])
        from trainwarden.agent.node.job_user import JobUserRefused, names, resolve_job_user
        who = {"users": names(s["job_users"]), "groups": names(s["job_groups"]),
               "privileged_groups": names(s["privileged_groups"])}
        if s["job_user"] is not None:  # a job_user that cannot be used stops the agent, not each job
            try:
                resolve_job_user(None, default=s["job_user"], allow_root=s["allow_root_jobs"], **who)
            except JobUserRefused as exc:
                raise ValueError(f"job_user {s['job_user']!r} cannot run jobs: {exc}") from None
        admin = None
        if s["etcd_admin_user"] or s["etcd_admin_password_file"]:
            from trainwarden.agent.node.job_etcd_identity import EtcdAdmin
            admin = EtcdAdmin(user=s["etcd_admin_user"] or "", password_file=s["etcd_admin_password_file"] or "")
        options = DaemonOptions(agent=config, etcd=s["etcd"], etcd_security=security, run_jobs=s["run_jobs"],
                                etcd_admin=admin,
                                local_addr=s["local_addr"], webhook=webhook, job_user=s["job_user"],
                                allow_root_jobs=s["allow_root_jobs"], job_users=who["users"],
                                job_groups=who["groups"], privileged_groups=who["privileged_groups"])
    except ValueError as exc:
        print(f"trainwarden agent: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    return run_daemon(options)
