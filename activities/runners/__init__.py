"""Agent runners: one interface, one implementation per place an agent can run."""
