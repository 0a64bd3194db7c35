"""Durable tasks: the SQLite store and the runner that owns every background coroutine."""
