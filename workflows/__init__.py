"""DARL's Temporal workflows and the contracts every other part of DARL speaks.

The workflows are deterministic: they reach the world only through activities. One module here
does I/O, `temporal_connection` (it reads the environment and TLS files), and only components
call it, never workflow code. Activities, the gateway and the trainer import from here; nothing
here imports them. See docs/architecture.md.
"""
