"""Batched small-matrix solvers: symmetric and general eigenvalues, the secular equation, singular values,
rank-revealing QR."""
