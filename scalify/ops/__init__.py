"""Ops users call inside models: valid with or without scalify."""
