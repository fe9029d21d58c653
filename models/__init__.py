"""deltalab models layer."""
