"""trainwarden's worker bootstrap: Python imports this at start-up because the launcher put its directory
first on PYTHONPATH (trainwarden.runtime.auto says what it arms, and when it does nothing).

Then the ``sitecustomize`` the rest of the path holds (the user's own, the distribution's) is loaded as if
this one were not there: an error in it is reported by ``site`` as it would be without trainwarden.
"""

import os
import sys


def _arm() -> None:
    try:
        from trainwarden.runtime.auto import bootstrap

        bootstrap()
    except Exception as exc:  # never stop the worker: it trains on, uninstrumented
        print(f"trainwarden: auto-instrumentation is off for this worker ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)


def _load_the_next_one() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_arm()
_load_the_next_one()
