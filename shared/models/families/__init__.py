"""One module per model family (each declares ``FAMILIES``); shared/models/registry.py lists
them."""
