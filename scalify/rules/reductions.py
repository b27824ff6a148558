"""Scale rules (being written)."""
