"""What the user sees: offline text dimmed on a terminal and taken back when the server judged
it; a pipe only ever gets committed text."""
from __future__ import annotations

import io

from edge_client.display import DIM, RESTORE_AND_CLEAR, SAVE_CURSOR, TerminalView
from testkit.tiny_model import byte_tokenizer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


TOKENIZER = byte_tokenizer().backend_tokenizer


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def run_view(out: io.StringIO) -> tuple[TerminalView, io.StringIO]:
    err = io.StringIO()
    view = TerminalView(TOKENIZER, out, err)
    view.committed(ids("The answer "))
    view.link_event("link lost")
    view.unverified(ids("is 41"))
    view.withdraw()
    view.committed(ids("is 42."))
    return view, err


def test_terminal_shows_offline_text_dimmed_then_takes_it_back():
    out = Terminal()
    _, err = run_view(out)
    text = out.getvalue()
    assert text == ("The answer " + SAVE_CURSOR + DIM + "is 41" + "\033[0m" + RESTORE_AND_CLEAR
                    + "is 42.")
    assert "link lost" in err.getvalue()


def test_pipe_gets_committed_text_only_and_kept_unverified_text_at_the_end():
    out = io.StringIO()
    view, _ = run_view(out)
    assert out.getvalue() == "The answer is 42."
    view.kept_unverified(ids(" Maybe."))
    assert out.getvalue() == "The answer is 42. Maybe."
