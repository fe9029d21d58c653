"""deltalab store layer."""
