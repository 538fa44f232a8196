"""Built-in integrations: one module per integration, each with `MANIFEST` and `HANDLERS` (see
catalogue.py)."""
