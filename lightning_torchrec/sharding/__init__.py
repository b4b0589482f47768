"""Sharding: tables, plans and ``DistributedModelParallel``.

``tables`` (what the model holds), ``layout`` (shards of ShardedTensor/DTensor), ``sharders``,
``setup_checks`` (configurations refused before planning), ``planning`` (topology, planner,
``shard_model``), ``plan_summary`` (the plan, readably) and ``key_order`` (outputs in the
unsharded key order on every plan).
"""
