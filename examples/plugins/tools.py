"""``rollout.multi_turn.tools``: a ``Tool`` for multi-turn rollouts (name, description, JSON schema, function)."""

from miles.rollout.tools import Tool


def _count(text: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    return str(len(text.split()))


word_count = Tool(
    name="word_count",
    description="Count the words in a text.",
    parameters={
        "type": "object",
        "properties": {"text": {"type": "string", "description": "The text to count the words of."}},
        "required": ["text"],
    },
    fn=_count,
)
