"""Runnable agents and inputs, smallest first."""
