"""Conveyor's built-in environments. Names resolve through ``shared.environments.registry``
(built-ins, the ``conveyor.environments`` entry points, and ``environments`` in settings);
this package holds only the implementations.

- ``guess_number``, ``qa``, ``single_turn``: text environments.
- ``coding``: a repository in a Docker sandbox, graded by hidden tests.
- ``gym_text``: any gym-style text environment (``reset(seed)``/``step(action)``), synchronous
  steps run off the event loop; ``textarena_env`` and ``skyrl_gym_env`` build on it.
"""
