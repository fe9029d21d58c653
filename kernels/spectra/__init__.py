"""Eigenvalues of token and window transitions: Householder products, per-channel gates, DPLR."""
