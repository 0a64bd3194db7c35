"""Configuration: the schema (`schema.py`, a pure description), loading it (`loader.py`), the files it names
(`keyfiles.py`) and the config in force, swapped on a reload (`live.py`). Imports only the wire's field checks."""
