"""trainwarden.runtime: the in-worker library imported by training scripts."""
