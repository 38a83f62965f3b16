"""DARL's Temporal workflows and the contracts every other part of DARL speaks.

Deterministic code only: no I/O, no torch, no httpx. Activities, the gateway and the trainer
import from here; nothing here imports them.
"""
