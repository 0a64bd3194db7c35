"""The durable task store: the only package that touches a database (SQLite, or PostgreSQL for replicas), its
ports (`contract.py`) composed by each backend. `open_store` picks the backend from the config (the PostgreSQL
driver is imported only when it is configured). Must not import aiohttp or the rest of tasks."""

from __future__ import annotations

from proxy.config.schema import StoreConfig
from proxy.tasks.store.base import (
    CANCEL,
    EXPIRED,
    INPUT,
    PURGED,
    RESYNC,
    STATUS,
    Change,
    Fence,
    FencedError,
    Message,
    StoreError,
    StoreFullError,
    StoreHealth,
    StoreLockedError,
    StoreUnavailableError,
    TaskQuery,
    Tombstone,
    page_key,
    parse_page_key,
)
from proxy.tasks.store.contract import Keys, OperatorQueries, Records, Replicas, TaskStore, Usage
from proxy.tasks.store.feed import LocalFeed
from proxy.tasks.store.keys import KeyRecord
from proxy.tasks.store.rows import record_from_row
from proxy.tasks.store.sqlite import SqliteTaskStore

__all__ = [
    "CANCEL",
    "EXPIRED",
    "INPUT",
    "PURGED",
    "RESYNC",
    "STATUS",
    "Change",
    "Fence",
    "FencedError",
    "KeyRecord",
    "Keys",
    "LocalFeed",
    "Message",
    "OperatorQueries",
    "Records",
    "Replicas",
    "SqliteTaskStore",
    "StoreError",
    "StoreFullError",
    "StoreHealth",
    "StoreLockedError",
    "StoreUnavailableError",
    "TaskQuery",
    "TaskStore",
    "Tombstone",
    "Usage",
    "open_store",
    "page_key",
    "parse_page_key",
    "record_from_row",
]


async def open_store(
    config: StoreConfig, *, max_records: int, read_only: bool = False, operator: bool = False
) -> TaskStore:
    """The configured store, open: PostgreSQL when `store.url` is set, else the SQLite file `store.path` (a
    relative path from the working directory, for `serve` and the CLI alike). `operator`: the CLI's writes
    beside running proxies (no schema migration; on SQLite, no file lock and an existing file only)."""
    if config.url is not None:
        from proxy.tasks.store.postgres import PostgresTaskStore

        return await PostgresTaskStore.open(
            config.url,
            max_records=max_records,
            password_file=config.password_file,
            pool_size=config.pool_size,
            connect_timeout_seconds=config.connect_timeout_seconds,
            timeout_seconds=config.timeout_seconds,
            read_only=read_only,
            migrate=not operator,
        )
    return await SqliteTaskStore.open(
        config.path, max_records=max_records, synchronous=config.synchronous, read_only=read_only, operator=operator
    )
