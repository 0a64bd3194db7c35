"""What operators use beside the MCP port: the admin listener (`admin.py`) and the `tasks` commands of the CLI
(`tasks_cli.py`), showing tasks alike (`_views.py`). Imports the store and the config; never the front or the
runner."""
