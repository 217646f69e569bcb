"""Incidents: the record and its lifecycle (``record``), where they are kept (``store``: the job's state
directory, a copy in etcd), the fleet's view read back from etcd (``fleet``), their counters (``counters``), and
the attribution of worker failures reported by torchrun to the rank that failed first (``worker_failures``).

It imports ``etcd`` (the key layout), ``common`` and ``shared``.
"""

from trainwarden.agent.incidents.counters import IncidentCollector
from trainwarden.agent.incidents.fleet import fleet_incidents
from trainwarden.agent.incidents.record import (IllegalIncidentTransition, Incident, IncidentKind, IncidentState,
                                                new_incident_id)
from trainwarden.agent.incidents.store import IncidentStore, list_incidents

__all__ = ["IllegalIncidentTransition", "Incident", "IncidentCollector", "IncidentKind", "IncidentState",
           "IncidentStore", "fleet_incidents", "list_incidents", "new_incident_id"]
