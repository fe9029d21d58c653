"""The data models are trained and evaluated on: state-tracking tasks (group word problems, parity,
modular arithmetic) and the byte-level corpus of Python's standard library."""
