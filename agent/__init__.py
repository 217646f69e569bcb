"""trainwarden.agent: node daemon, launcher, control CLI and rendezvous backend.

Importing this package must not import torch: the daemon starts fast and stays small.
"""

__version__ = "0.1.0"
