"""Durable tasks: the call machine, the executor of its commands and its effects, the services beside
them, and the store."""
