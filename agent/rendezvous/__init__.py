"""The ``etcd3`` torchrun rendezvous backend (``backend``), the c10d store it uses (``store``), and the etcd-native
round (``native``: a key per node, one closing transaction; torch-free) with its torchrun handler
(``native_handler``, ``--rdzv-conf round=native``: `trainwarden run`'s default, ``--rendezvous-round``).

torchrun finds the backend through the ``torchrun.handlers`` entry point ``etcd3 =
trainwarden.agent.rendezvous:handler_factory``. This is the one agent package that imports torch (it runs
inside torchrun), so nothing here is imported eagerly: ``handler_factory`` defers to ``backend`` when torch
calls the creator it returns, and the other public names load on first use. It imports ``etcd``.
"""

__all__ = ["Etcd3RendezvousBackend", "Etcd3RendezvousConfig", "Etcd3Store", "NativeRendezvous", "NativeRendezvousConfig",
           "create_rdzv_handler", "handler_factory"]


def handler_factory():
    """Entry point of ``torchrun.handlers``: torch calls it with no arguments and registers the creator.

    Importing ``torch.distributed.elastic.rendezvous`` loads every ``torchrun.handlers`` entry point, this one
    included; so the factory must not import torch itself, and the creator resolves the backend when called.
    """
    return _create_rdzv_handler


def _create_rdzv_handler(params):
    from trainwarden.agent.rendezvous.backend import create_rdzv_handler

    return create_rdzv_handler(params)


def __getattr__(name):
    if name in ("NativeRendezvous", "NativeRendezvousConfig"):
        from trainwarden.agent.rendezvous import native

        return getattr(native, name)
    if name == "Etcd3Store":
        from trainwarden.agent.rendezvous import store

        return store.Etcd3Store
    if name in __all__:
        from trainwarden.agent.rendezvous import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
