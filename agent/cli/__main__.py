"""``python -m trainwarden.agent.cli``: the same as the ``trainwarden`` command."""

from trainwarden.agent.cli.main import entry

entry()
