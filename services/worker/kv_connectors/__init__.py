"""KV connectors (how KV blocks move between workers) and the worker's KV tiers: the interfaces
and the factory are in base.py; each transport is one module (nats.py, inproc.py)."""
