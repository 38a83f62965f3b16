"""DARL's trainer side: trajectory aggregation into training rows, the trainer backends
(`reference` on CPU, `verl`) and their checkpoints, and weight sync (loading each step's
weights into the policy servers of `serving/`)."""
