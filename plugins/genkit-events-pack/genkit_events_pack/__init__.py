"""genkit-events-pack: the ``jsonl`` streamer and the ``ngram_corpus`` candidate generator.

Imported at discovery time, so it imports no torch; the items are ``"module:attr"`` strings that
load on first use.
"""

from __future__ import annotations

from collections.abc import Callable

from genkit import hookimpl

__version__ = "0.1.0"

_M = "genkit_events_pack"


@hookimpl
def register_streamers(register: Callable[..., None]) -> None:
    register("jsonl", f"{_M}.jsonl:make_jsonl_streamer",
             description="JSON-lines token events with timings, to $GENKIT_JSONL_PATH or stdout.")


@hookimpl
def register_candidate_generators(register: Callable[..., None]) -> None:
    register("ngram_corpus", f"{_M}.ngram:ngram_corpus",
             description="Drafts from n-gram matches in a user-given corpus (token ids, or texts + tokenizer).")
