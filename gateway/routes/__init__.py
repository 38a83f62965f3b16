"""The gateway's HTTP routes: the agents' (`agent.py`: the model APIs under a rollout's token, and
Agent Lightning's), the admin API with health and metrics (`admin.py`), and what both take from a
request (`dependencies.py`, `bodies.py`)."""
