"""``python -m trainwarden.agent.cli``: the same as the ``trainwarden`` command."""

import sys

from trainwarden.agent.cli.main import main

sys.exit(main())
