"""The tutorial's agent, reward, tasks and configs (docs/tutorials/your-own-agent.md): files a
reader copies into an empty directory and runs from there."""
