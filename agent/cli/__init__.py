"""The ``trainwarden`` command line: ``main`` parses the arguments, and each command's work lives in a module
of its own (``status`` for ``status``/``top``, ``incidents``; ``run`` and ``agent`` hand over to ``launch`` and
``node``). Bad input is one line on stderr and ``EXIT_USAGE``. It may import every other layer; none imports it.
"""

from trainwarden.agent.cli.main import build_parser, entry, main

__all__ = ["build_parser", "entry", "main"]
