"""Who may do what on the bus and in the store: one table of roles and their NATS subjects and
Redis keys (grants.py), the nats-server and redis-server configurations made from it
(render.py), fresh per-role credentials written to a directory (credentials.py), and the
connection options each service builds from its settings (connect.py)."""
