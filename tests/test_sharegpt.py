"""ShareGPT as the draft head's data: the streaming reader on the shipped (truncated) file and on
files that are not ShareGPT, the chat-template rendering of whole conversations, and decontamination
of real records made near an MT-Bench prompt."""

from __future__ import annotations

import json

import pytest

from ogspo.artifacts.prompts import read_mtbench, render_conversation
from ogspo.artifacts.sharegpt import read_sharegpt, sharegpt_path
from ogspo.drafter.data import sharegpt_texts


def _record(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_the_shipped_file_is_read_to_its_last_complete_record():
    read = read_sharegpt()
    assert read.truncated and read.records == 17671  # the package's file stops inside record 17672
    assert len(read.conversations) + read.dropped == read.records and len(read.conversations) > 17000
    for c in read.conversations[::500]:
        roles = [r for r, _ in c.turns]
        assert roles[0] == "user" and roles[-1] == "assistant" and len(roles) % 2 == 0
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating
    assert read_sharegpt(limit=5).conversations == read.conversations[:5]
    assert sharegpt_path().name == "ShareGPT_V3_unfiltered_cleaned_split.json"


def test_reader_keeps_complete_records_and_stops_at_a_cut(tmp_path):
    records = [_record(0, ("human", "Hi there, how are you?"), ("gpt", "Fine, thanks.")),
               _record(1, ("gpt", "An opening without a question."), ("human", "Tell me a joke."), ("gpt", "No.")),
               _record(2, ("human", "Only a question")),  # no answer: dropped
               _record(3, ("human", "What is 2 + 2?"), ("gpt", "4"), ("human", "And 3 + 3?"))]
    whole = json.dumps(records, indent=2)
    path = tmp_path / "whole.json"
    path.write_text(whole)
    read = read_sharegpt(path)
    assert not read.truncated and read.records == 4 and read.dropped == 1
    assert [c.conversation_id for c in read.conversations] == ["r0", "r1", "r3"]
    assert read.conversations[1].turns == (("user", "Tell me a joke."), ("assistant", "No."))
    assert read.conversations[2].turns == (("user", "What is 2 + 2?"), ("assistant", "4"))  # unanswered last turn dropped
    for cut in (whole.index('"r3"') + 20, whole.index('"r3"') - 3, len(whole) - 2):  # inside a string, between keys, before ']'
        path.write_text(whole[:cut])
        read = read_sharegpt(path)
        kept = ["r0", "r1", "r3"] if cut == len(whole) - 2 else ["r0", "r1"]
        assert read.truncated and [c.conversation_id for c in read.conversations] == kept


@pytest.mark.parametrize("text, what", [
    ('{"id": "x"}', "does not start with a JSON array"),
    ('[{"id": "x", "conversations": "no"}]', "record 0 is not a ShareGPT record"),
    ('[{"id": "x", "conversations": [{"from": "human"}]}]', "record 0 has a turn without string 'from' and 'value'"),
    ('[{"id": "x", "conversations": []} {"id": "y"}]', "expected ',' or ']' after record 0"),
    ('[{"id": "x", "conversations": [{"from": "human", "value": "a" b}]}, {"id": "y", "conversations": []}]', "not valid JSON"),
])
def test_a_file_that_is_not_sharegpt_gets_one_line(tmp_path, text, what):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=what) as err:
        read_sharegpt(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_real_records_near_an_mtbench_prompt_are_dropped(smollm2_dir):
    """Real ShareGPT records made near an MT-Bench prompt: one quoting it inside an answer is dropped
    as text (read whole), one asking it as its first turn is dropped as text and as a request; the
    untouched records are kept, rendered through the chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    real = read_sharegpt(limit=6).conversations
    prompt = read_mtbench()[0].text
    quoting = type(real[0])("quoting", real[0].turns[:1] + (("assistant", f"Sure. {prompt} Here it is."),) + real[0].turns[2:])
    asking = type(real[1])("asking", (("user", prompt),) + real[1].turns[1:])
    convs = [quoting, *real[2:6], asking]
    kw = dict(max_prompt_tokens=4096, held_out=[prompt], seed=0)
    texts, requests, dropped = sharegpt_texts(convs, tok, n_text=len(convs), n_answer=0, **kw)
    assert dropped["near_held_out"] == 2 and len(texts) == 4 and not requests
    texts_, requests, dropped = sharegpt_texts(convs, tok, n_text=0, n_answer=len(convs), **kw)
    assert dropped["near_held_out"] == 1 and len(requests) == 5 and not texts_  # quoting's first turn is clean
    words = " ".join(prompt.split()[:8])
    assert all(words not in t.text and words not in t.prompt for t in texts + requests)
    by_text = {"\n\n".join(t for _, t in c.turns): c for c in convs}
    for t in texts:
        assert t.prompt == render_conversation(tok, by_text[t.text].turns)
        assert t.prompt.count("<|im_start|>user") == t.prompt.count("<|im_start|>assistant") >= 1
