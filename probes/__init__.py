"""deltalab probes layer."""
