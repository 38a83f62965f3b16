"""DARL's Temporal workflows and the contracts every other part of DARL speaks.

Deterministic code only: the workflows reach the world through activities, and nothing here
does I/O (how components connect to Temporal is `deploy/temporal_connection.py`). Activities,
the gateway and the trainer import from here; nothing here imports them. See
docs/architecture.md.
"""
