"""The task services beside the executor: starting and resuming calls, task operations, recovery and sweeps, the
replica link and its inbox, push, idempotency keys, quotas, pacing, and the executor's observers. Each gets the
shared `TasksContext`; none imports aiohttp's web side or the front."""
