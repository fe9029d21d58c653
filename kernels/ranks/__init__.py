"""State ranks over time, rebuilt from chunk-boundary states: references and fast forms."""
