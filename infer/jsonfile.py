"""Items of a JSON array or of JSON Lines, each with where it stands in its file.

Prompt files (`infer.tuning.acceptance.load_prompts`) and training data (`train.data.check_json`) accept
both shapes and name the line of a malformed one; what an item must be is each caller's to check, with
the place given here. It lives at the bottom layer so that both can import it.
"""

from __future__ import annotations

import json


def json_items(text: str, source: str, hint: str) -> list[tuple[str, object]]:
    """(where, item) for each element of a top-level JSON array in `text`, or for each non-blank line.

    `where` reads "<source>: element <i> of the array" or "<source>: line <n>"; `hint` says what a line
    should hold and ends the error raised for one that is not valid JSON.
    """
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: line {err.lineno} is not valid JSON ({err.msg}, column {err.colno}); "
                             "fix that line") from None
        return [(f"{source}: element {i} of the array", item) for i, item in enumerate(items)]
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            found.append((f"{source}: line {number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: line {number} is not valid JSON ({err.msg}, column {err.colno}); fix "
                             f"or remove that line (JSON Lines: {hint})") from None
    return found
