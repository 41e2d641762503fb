"""A completion's text by where each token came from, for ``agentspec cache show``.

In colour (a terminal): each draft source's tokens in its own colour, the target's own tokens
in the terminal's plain colour, and every other step underlined, so each step's boundary is
where the underline starts or stops; a legend gives each origin's token count. Plain (``--no-color``,
a pipe, ``NO_COLOR``): every run opens with its origin in brackets (``[memory]``) and a ``|``
separates two steps. Imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text

from agentspec.types import TARGET_ORIGIN, Origins

# The draft sources' colours (the server's page uses the same hues); sources not named here
# take the spare colours in order of appearance.
COLORS = {"memory": "green", "prompt_lookup": "blue", "suffix": "magenta", "model": "yellow",
          "head": "cyan", "grammar": "bright_black"}
SPARE = ("red", "bright_green", "bright_blue", "bright_magenta", "bright_yellow", "bright_cyan")


def colors(origins: Origins) -> dict[str, str | None]:
    """Each origin's colour (None: the target's own tokens, in the plain colour)."""
    out: dict[str, str | None] = {}
    spare = iter(SPARE * (1 + len(origins.counts()) // len(SPARE)))
    for source in origins.counts():
        out[source] = None if source == TARGET_ORIGIN else COLORS.get(source) or next(spare)
    return out


def styled(text: str, origins: Origins) -> Text:
    """``text`` coloured by origin, every other step underlined."""
    palette = colors(origins)
    out = Text()
    for step, source, _, piece in origins.pieces(text):
        out.append(piece, Style(color=palette[source], underline=step % 2 == 1))
    return out


def plain(text: str, origins: Origins) -> str:
    """``text`` with each run's origin in brackets before it, and ``|`` between steps."""
    parts, last = [], -1
    for step, source, _, piece in origins.pieces(text):
        if step != last and last >= 0:
            parts.append("|")
        parts.append(f"[{source}]{piece}")
        last = step
    return "".join(parts)


def legend(origins: Origins, *, color: bool) -> Text:
    """Each origin's token count (in its colour), then the number of steps."""
    out = Text()
    for source, n in origins.counts().items():
        shown = "target (the model itself)" if source == TARGET_ORIGIN else source
        if color:
            out.append("■ ", Style(color=colors(origins)[source]))
        out.append(f"{shown} {n}   ")
    out.append(f"in {len(origins.steps)} steps")
    if color:
        out.append(" (underlined every other step)")
    return out


def as_json(text: str, origins: Origins) -> dict[str, Any]:
    """The origins for ``--json``: counts, tokens per step, and the runs with their text
    (where the record kept where each run ends in it)."""
    out: dict[str, Any] = {"counts": origins.counts(), "steps": list(origins.steps)}
    if origins.text_ends is not None:
        out["runs"] = [{"step": step, "source": source, "tokens": n, "text": piece}
                       for step, source, n, piece in origins.pieces(text)]
    return out


def show(console: Any, text: str, origins: Origins | None, *, color: bool) -> None:
    """Print the completion by origin on ``console`` (a rich Console)."""
    console.rule("completion by origin")
    if origins is None:
        console.print("no origins kept for this record (written by an agentspec before they "
                      "were kept, or not by a Speculator)", markup=False)
        return
    if origins.text_ends is None:  # recorded without its text's runs: counts only
        console.print(legend(origins, color=color))
        return
    if color:
        console.print(styled(text, origins))
    else:
        console.print(plain(text, origins), markup=False, highlight=False, soft_wrap=True)
    console.print(legend(origins, color=color))
