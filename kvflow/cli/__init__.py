"""The `kvflow` command line and the launcher that starts a whole stack on one machine."""
