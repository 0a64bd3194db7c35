"""What the tests share and are not tests themselves: clients of the proxy, the `until(...)` deadline helper,
wire and schema helpers, record builders, child processes (upstream fixtures, proxies, replicas).

Test modules import from here (and pytest fixtures from conftest.py); no test module imports another, nor
conftest. Nothing here imports a test module.
"""
