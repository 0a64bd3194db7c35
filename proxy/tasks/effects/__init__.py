"""The effects: each carries out one kind of the machine's commands and owns the state that needs (slots and
parking, record writes, the held upstream request, a task the upstream runs itself, the client's reply and
stream, timers). Each reaches back only through `ports.py` and is tested alone with a fake `Feed`."""
