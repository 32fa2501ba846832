"""Agent-driven episodes: the agent episode, the recording proxy its model calls go through,
the agents' images and artifacts (``episode`` drives them, ``agents.episode`` runs one)."""
