"""Conveyor's weights plane: how a trained policy version reaches every vLLM replica.

The trainer publishes into it (an S3 checkpoint, sharded or whole, announced for the follower,
and optionally an NCCL broadcast, ``broadcast`` over the process group of ``group``, driven by
the trainer's ``services.trainer.broadcast_publish``, or a version of the run's delta chain,
``delta_chain`` with the codec ``delta``, from ``services.trainer.delta_publish``); the follower
(``follower``) reads the checkpoint announcements and brings each replica to the new version
(``checkpoint_apply``) through ``sync``, which composes the phases of a ``replica_set`` (pause,
load, probe, label, resume), a LoRA adapter through ``lora_sync``, a run's version 0 through
``base``, and a delta-chain version through ``delta_sync`` (applied by the worker to its
``delta_shadow``). ``probe`` (with ``services.policy.probe``) is the check that a replica
serves exactly the trainer's weights; ``checkpoint_files`` reads a committed checkpoint;
``admin_http`` holds the replicas' admin calls. The sync record (a Redis key) stays with its
owner in ``shared.state.weight_sync_record``.

Invariants:
- ``services.inference`` keeps only the vLLM launcher (server, GPU launch, command line, the
  worker extension vLLM imports by dotted path) and the tiny model; the trainer reaches
  inference only through this package, never by importing ``services.inference``
  (tests/unit/test_import_boundaries.py).
- Arrows run one way, trainer -> weights -> inference: this package imports no trainer code;
  the policy model and its probe live beneath both, in ``services.policy``
  (tests/unit/test_import_boundaries.py).
"""
