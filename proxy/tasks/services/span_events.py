"""The span events of a call's questions, emitted through the executor's observer hook (never from inside an
effect): a question the upstream asked (`input_requested`: its method and whether it was refused at once), an
answer or a refusal sent back upstream (`input_answered`), an MRTR round handed to the client
(`mrtr_input_required`: its round and how many questions), a retry that took it back
(`mrtr_resumed`: the round it answers and how many answers). Methods and counts only, never content. Imports the
command vocabulary, the live call, tracing and the refusal rule.
"""

from __future__ import annotations

from proxy.observe import tracing
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Answer, Asked, Command, Event, Parked, Refuse, Resumed
from proxy.wire.upstream_events import refusal


class SpanEvents:
    """An executor observer: marks on the current span what each event of a call did with its questions."""

    def __call__(self, call: LiveCall, event: Event, commands: list[Command]) -> None:
        if isinstance(event, Asked):
            question = event.question
            refused = any(isinstance(command, Refuse) and command.upstream_id == question.id for command in commands)
            tracing.event("input_requested", {"mcp.method.name": question.method, "refused": refused})
        elif isinstance(event, Parked):
            tracing.event("mrtr_input_required", {"round": call.state.round, "questions": len(call.state.inputs)})
        elif isinstance(event, Resumed):
            tracing.event("mrtr_resumed", {"round": call.state.round, "answers": len(event.answers)})
        for command in commands:
            if isinstance(command, Answer) and call.upstream.session is not None:
                tracing.event("input_answered", {"refused": False})
            elif isinstance(command, Refuse) and call.upstream.session is not None:
                _, error = refusal(command.method)
                tracing.event("input_answered", {"refused": error is not None})
