"""Code every kvflow service uses: wire messages, the NATS bus, settings, model loading."""
