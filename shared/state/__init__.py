"""Conveyor's Redis state: the modules that own Redis keys, the only ones that name them.

Every Redis key ``shared.names.RedisKeys`` declares has one owner module
(``shared.names.REDIS_KEY_OWNERS``), the only module that names it; any other reads or changes
the key through its owner's methods (``tests/unit/test_key_ownership.py`` fails otherwise). A
Lua script that changes keys of several owners in one atomic call gets each key from its owner.

The owners here: the trajectory ledger and its Lua scripts (``ledger``, ``ledger_lua``,
``ledger_retry``, ``redis_scripts``), leases (``leases``), the staleness bound (``staleness``),
the policy version (``policy_version``), the group registry (``group_registry``), the trainer's
counters, stream and reads (``trainer_counters``, ``trainer_stream``, ``trainer_reads``), the run
marker and stop request (``run_marker``, ``run_stop``), intake's records of a run
(``run_records``), the train queue and its selection commits (``train_queue``), the step
metrics (``step_metrics``), the checkpoint announcements (``checkpoint_announcements``), the
eval passes' ends (``eval_ends``), dead letters (``dead_letters``) and the
weight-sync record (``weight_sync_record``).
"""
