"""The worker's halves of the KV connectors (how KV blocks move between workers) and its KV
tiers: the interfaces are in base.py; each transport is one module (nats.py, inproc.py), built
by name by factory.py (the names are shared/kv_connectors.py's)."""
