"""Reference workloads that run under trainwarden."""
