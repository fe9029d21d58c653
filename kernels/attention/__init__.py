"""Exact attention maps of delta-rule and DPLR layers: dense oracles, chunked forms, a Triton kernel."""
