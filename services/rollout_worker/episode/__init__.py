"""The episode path: the token loop (``loop``), the drivers that pick it or the agent
episode (``drivers``), and trials of several episodes (``trials``)."""
