"""etcd, the cluster's memory: one client constructor, the key layout, the embedded server, the job records.

``client`` opens every etcd client trainwarden uses (one ``EtcdConfig`` with the endpoints and the TLS/auth
settings); ``keys`` builds every key under ``/trainwarden/v1``; ``embedded`` runs the single-member etcd that
``trainwarden run`` starts when no ``--etcd`` is given (``embedded_auth``: its root password); ``job_credentials``
makes an etcd user confined to one job's keys; ``job_records`` reads and writes a job's spec, state and checkpoint
pointer. It imports ``common`` and ``shared`` only.
"""

from trainwarden.agent.etcd.client import (EtcdAccessDenied, EtcdConfig, EtcdError, EtcdUnavailable, open_etcd,
                                          split_endpoint)
from trainwarden.agent.etcd.embedded import EmbeddedEtcd
from trainwarden.agent.etcd.job_records import JobRecords
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key

__all__ = ["DEFAULT_PREFIX", "EmbeddedEtcd", "EtcdAccessDenied", "EtcdConfig", "EtcdError", "EtcdUnavailable",
           "JobRecords", "job_key", "open_etcd", "split_endpoint"]
