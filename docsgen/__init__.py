"""The documentation site's generated references (built by mkdocs through `docsgen/hooks.py`)."""
