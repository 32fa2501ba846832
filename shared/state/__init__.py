"""Conveyor's Redis state: the only modules that name Redis keys.

Every Redis key ``shared.names.RedisKeys`` declares has one owner module here (``shared.names``
records which); a service reads or changes that key only through its owner's methods, never by
naming the key itself. The owners: the trajectory ledger and its Lua scripts (``ledger``,
``ledger_lua``, ``ledger_retry``, ``redis_scripts``), leases (``leases``), the staleness
bound (``staleness``), the policy version (``policy_version``), the group registry
(``group_registry``), the trainer's counters, stream and reads (``trainer_counters``,
``trainer_stream``, ``trainer_reads``), the run marker and stop request (``run_marker``,
``run_stop``), dead letters (``dead_letters``) and the weight-sync record
(``weight_sync_record``).
"""
