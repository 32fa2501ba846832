"""Drivers that run INSIDE the sandbox as an ``agent_coding`` ``agent_command``, for agents that
are not a command line of their own (Cline: a gRPC server and a host bridge).

Invariants:
- This package is copied into agent images on its own (``images/agents/<agent>/modules.txt``):
  it imports the standard library, its recipe's packages and itself, never the rest of Conveyor.
- A driver leaves nothing running when it returns or is stopped (SIGTERM), and it writes what
  the episode should keep into ``$AGENT_ARTIFACTS_DIR`` (``metrics.json`` among them).
"""
