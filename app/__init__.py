"""deltalab app layer."""
