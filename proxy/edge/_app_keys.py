"""What the aiohttp application holds, by key: the config as started and in force, the services the lifecycle
opens (`_lifecycle.py`) and the handlers read (`app.py`, `_ops.py`, `_admission.py`)."""

from __future__ import annotations

import socket
from typing import Final

from aiohttp import web

from proxy.config.live import LiveConfig
from proxy.config.schema import Config
from proxy.edge._jwt_identity import JwtIdentity
from proxy.edge._relay import OriginRelay
from proxy.front.dispatch import Front
from proxy.legacy import LegacyFront
from proxy.operators.admin import Admin
from proxy.tasks.runner import TaskRunner
from proxy.tasks.store import TaskStore
from proxy.upstream.pool import SessionPool

CONFIG: Final = web.AppKey("config", Config)  # as started: what a reload cannot change is read here
LIVE: Final = web.AppKey("live", LiveConfig)  # the config in force: what may change live is read through it
FRONT: Final = web.AppKey("front", Front)
PASSTHROUGH: Final = web.AppKey("passthrough", LegacyFront)
RELAY: Final = web.AppKey("relay", OriginRelay)
JWT: Final = web.AppKey("jwt", JwtIdentity)
POOL: Final = web.AppKey("pool", SessionPool)
STORE: Final = web.AppKey("store", TaskStore)
RUNNER: Final = web.AppKey("runner", TaskRunner)
STOPPING: Final = web.AppKey("stopping", list[bool])
ADMIN: Final = web.AppKey("admin", Admin)  # the operators' listener, when `admin.port` is set
ADMIN_SOCKETS: Final = web.AppKey("admin_sockets", list[socket.socket])  # bound by the serve loop before the start
