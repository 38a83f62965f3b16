"""DARL's trajectory viewer: a read-only web app over Temporal visibility, the trajectory store
and the run files."""
