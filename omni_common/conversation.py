"""A Generate request's conversation (``ChatMessage`` s): checked the same
way by the gateway and the decoder, as (role, text) turns.

Roles are ``system``, ``user`` and ``assistant``; the last turn is the
user's (the model's reply follows it); a turn's text parts are joined by
newlines and must not be blank; all turns together have at most
``max_chars`` characters. Every refusal names the field
(``messages[2].role``, ``messages[0].content[1]``).
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_common.errors import InvalidArgumentError, quote_value

__all__ = ["ROLES", "Turn", "conversation_from_pb", "last_user_text"]

ROLES = ("system", "user", "assistant")
Turn = tuple[str, str]  # (role, text)


def conversation_from_pb(messages: Sequence, max_chars: int, field: str = "messages") -> tuple[Turn, ...]:
    """The (role, text) turns of ``messages`` (``common_pb2.ChatMessage``), checked."""
    turns: list[Turn] = []
    total = 0
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if message.role not in ROLES:
            raise InvalidArgumentError(f"{where}.role",
                                       f"unknown role {quote_value(message.role)}; roles: {', '.join(ROLES)}")
        texts = []
        for j, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            if kind != "text":
                raise InvalidArgumentError(f"{where}.content[{j}]",
                                           "is empty" if kind is None else f"{kind} parts are not taken here")
            texts.append(part.text)
        text = "\n".join(texts)
        if not text.strip():
            raise InvalidArgumentError(f"{where}.content", "has no text")
        total += len(text)
        if total > max_chars:
            raise InvalidArgumentError(
                f"{where}.content",
                f"the conversation has {total} characters up to here; the limit is {max_chars} in all")
        turns.append((message.role, text))
    if not turns:
        raise InvalidArgumentError(field, "is empty")
    if turns[-1][0] != "user":
        raise InvalidArgumentError(f"{field}[{len(turns) - 1}].role",
                                   "the last turn must be the user's (the model's reply follows it)")
    return tuple(turns)


def last_user_text(turns: Sequence[Turn]) -> str:
    """The text of the last user turn (what an engine without a chat template reads)."""
    return next(text for role, text in reversed(turns) if role == "user")
