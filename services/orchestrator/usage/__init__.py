"""Billing calls on their way: model calls' usage records and turns' run charges.

`batches.py`: each model call's usage is recorded with billing whether the turn succeeds,
fails or is cancelled. The records of all runs of this process are gathered for at most
`window_s` and sent as one `RecordUsageBatch` (one RPC per model call cost ~0.8 ms of CPU,
docs/performance.md). A run's end writes its records still waiting into its own transaction
as a stored call (`billing_redeliveries`, a transactional outbox: `UsageBatcher.take`), so its
terminal event does not wait for billing; the stored records of the runs that end within
STORED_LINGER_S (0.2 s) go to billing in one call, and their rows are then deleted. A turn's
run charge is written with the turn and sent the same way in one `ChargeBatch` (`RunCharges`).
Records are idempotent by (run_id, call_index), so a retried batch only replays. A crash can
lose at most the window plus the RPC in flight, for the records of runs that have not ended.

`redelivery.py`: a billing call that fails its quick retries (`call_with_retries`: three sends
within QUICK_BUDGET_S, 2 s, deadlines included) is stored in the orchestrator's database by
`Redelivery` and sent again in the background (1 s, doubling to 60 s apart, for up to 7 days),
as are the tool charges of loop.py. A stored call survives a stop or crash of the process: the
next start (or, on PostgreSQL, another replica) sends it. Only a billing service gone for the
whole 7 days loses it, logged at ERROR with its run and call.
"""
