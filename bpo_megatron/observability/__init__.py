"""observability."""
