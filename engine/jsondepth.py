"""json_depth(text): how deeply a JSON text nests, counted without parsing (no recursion), so
that untrusted JSON (a request body, a file a host sent) is refused before json.loads can hit
Python's recursion limit. Below every layer: the server and the orchestration both use it."""

from __future__ import annotations


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text (strings skipped)."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif ch in "]}":
            depth -= 1
    return deepest
