"""Data for `roundpipe train`: byte tokenizer, synthetic tasks, chat loss masks, packing, resumable order."""

from __future__ import annotations

import json

import pytest
import torch

from roundpipe.cli.config import ConfigError
from roundpipe.cli.data import FileStream, chat_segments, file_stream, load_examples, pack_examples, pad_examples
from roundpipe.cli.tasks import (
    IGNORE_INDEX,
    TASKS,
    TaskStream,
    byte_tokenizer,
    exact_match,
    held_out_examples,
    is_held_out,
)


def test_byte_tokenizer_round_trips_offline(tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = byte_tokenizer()
    text = "héllo, 世界 <|im_end|>!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:3] == list("hé".encode())  # token id = byte value
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again(text, add_special_tokens=False)["input_ids"] == ids and again.chat_template == tok.chat_template


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_examples(name: str) -> None:
    task = TASKS[name]
    stream = TaskStream(task, batch_size=300, seed=0)
    ids, labels = stream.next_batch()
    assert ids.shape == labels.shape == (300, task.seq_len)
    assert (labels[:, : task.prompt_len] == IGNORE_INDEX).all() and (
        labels[:, task.prompt_len :] == ids[:, task.prompt_len :]
    ).all()
    prompts = {bytes(row[: task.prompt_len]).decode() for row in ids.tolist()}
    assert not any(is_held_out(p) for p in prompts)  # training never sees a held-out problem
    held = held_out_examples(task, 50)
    assert len(held) == 50 and all(is_held_out(p) for p, _ in held)
    assert all(len(p) == task.prompt_len and len(a) == task.answer_len for p, a in held)


def test_task_stream_resumes_exactly() -> None:
    a = TaskStream(TASKS["reverse"], 8, seed=3)
    a.next_batch()
    state = a.state_dict()
    want = [a.next_batch()[0] for _ in range(3)]
    b = TaskStream(TASKS["reverse"], 8, seed=99)
    b.load_state_dict(state)
    assert all(torch.equal(x, b.next_batch()[0]) for x in want)


def test_exact_match_scores_greedy_answers() -> None:
    task = TASKS["reverse"]
    examples = held_out_examples(task, 4)

    def oracle(ids: torch.Tensor) -> torch.Tensor:  # knows the answers, except for the last example
        out = torch.zeros(ids.shape[0], 260)
        for i, row in enumerate(ids.tolist()):
            prompt, answer = examples[i]
            pos = len(row) - task.prompt_len
            out[i, ord(answer[pos]) if i < 3 else ord("x")] = 1
        return out

    acc, results = exact_match(oracle, task, examples)
    assert acc == 0.75 and results[0][2] == examples[0][1] and results[3][2] == "x" * task.answer_len


def trained_text(tok, ids, labels) -> str:
    return tok.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX])


def test_chat_jsonl_trains_on_responses_only(tmp_path) -> None:
    tok = byte_tokenizer()
    rows = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ]
        },
        {"prompt": "capital of France?", "response": "Paris"},
        {"text": "plain text row"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (chat, c_labels), (qa, qa_labels), (plain, p_labels) = load_examples(str(path), tok)
    assert tok.decode(chat) == tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert trained_text(tok, chat, c_labels) == "hello<|im_end|>\n4<|im_end|>\n"
    assert trained_text(tok, qa, qa_labels) == "Paris<|im_end|>\n"
    assert trained_text(tok, plain, p_labels) == "plain text row<|endoftext|>" and plain[-1] == tok.eos_token_id


def test_chat_template_that_rewrites_history_gives_one_example_per_turn() -> None:
    """Like Qwen3's, this template renders past assistant turns differently from the last one."""
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: <think></think>{% endif %}"
    )
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    segments = chat_segments(tok, msgs)
    assert segments == [
        [("user: a\nassistant: <think></think>", False), ("b\n", True)],
        [("user: a\nassistant: b\nuser: c\nassistant: <think></think>", False), ("d\n", True)],
    ]


def test_row_without_known_fields_is_a_user_error(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"content": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1 has none of the fields"):
        load_examples(str(path), byte_tokenizer())
    path.write_text("{not json\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1 is not valid JSON"):
        load_examples(str(path), byte_tokenizer())


def test_txt_is_packed_into_full_rows(tmp_path) -> None:
    tok = byte_tokenizer()
    text = "".join(chr(97 + i % 26) for i in range(1000))
    path = tmp_path / "book.txt"
    path.write_text(text)
    stream = file_stream(str(path), tok, seq_len=64, pack=True, batch_size=4, seed=0)
    assert stream.input_ids.shape == (1001 // 64, 64)  # 1000 bytes + EOS, remainder dropped
    assert bytes(stream.input_ids.flatten().tolist()).decode() == text[: 15 * 64]
    assert torch.equal(stream.labels, stream.input_ids)


def test_pack_and_pad() -> None:
    ex = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6, 7, 8, 9], [6, -100, 8, 9])]
    ids, labels = pack_examples(ex, 4)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]] and labels.tolist() == [[-100, 2, 3, 4], [5, 6, -100, 8]]
    ids, labels = pad_examples(ex, 3, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 5, 0], [6, 7, 8]] and labels.tolist() == [
        [-100, 2, 3],
        [4, 5, -100],
        [6, -100, 8],
    ]
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        pack_examples(ex, 100)


def test_file_stream_covers_each_epoch_and_resumes() -> None:
    ids = torch.arange(10).view(10, 1)
    a = FileStream(ids, ids, batch_size=4, seed=0, description="")
    first_epoch = torch.cat([a.next_batch()[0] for _ in range(2)] + [a.next_batch()[0][:2]]).flatten()
    assert sorted(first_epoch.tolist()) == list(range(10))  # batch 3 takes 2 rows of epoch 0, 2 of epoch 1
    state = a.state_dict()
    assert state == {"epoch": 1, "offset": 2}
    want = [a.next_batch()[0] for _ in range(4)]
    b = FileStream(ids, ids, batch_size=4, seed=0, description="")
    b.load_state_dict(state)
    assert all(torch.equal(w, b.next_batch()[0]) for w in want)


def test_a_batch_is_at_most_the_data() -> None:
    """Every row of the data in one batch is the most a batch takes; one more would repeat a row in it."""
    ids = torch.arange(3).view(3, 1)
    whole = FileStream(ids, ids, batch_size=3, seed=0, description="")
    assert sorted(whole.next_batch()[0].flatten().tolist()) == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"batch_size=4 is more than the 3 row\(s\) of the data: .* 1\.3 times"):
        FileStream(ids, ids, batch_size=4, seed=0, description="")


def test_parquet_rows(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["hi"], "response": ["ho"]}), path)
    ((ids, labels),) = load_examples(path, byte_tokenizer())
    assert trained_text(byte_tokenizer(), ids, labels) == "ho<|im_end|>\n"


def test_parquet_without_reader_is_a_user_error(tmp_path, monkeypatch) -> None:
    import sys

    for name in ("datasets", "pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match="needs the 'datasets' package") as info:
        load_examples(str(path), byte_tokenizer())
    assert info.value.fix.startswith("pip install datasets")


def test_chat_rows_without_an_assistant_turn_are_dropped_with_a_warning(tmp_path, caplog) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with caplog.at_level("WARNING", logger="roundpipe"):
        examples = load_examples(str(path), byte_tokenizer())
    assert len(examples) == 1
    assert (
        "2 of 3 rows have chat messages without an 'assistant' turn (roles found: gpt, human, user); they were dropped"
        in caplog.text
    )
    assert "rename the roles 'gpt', 'human' to user/assistant" in caplog.text


def test_text_and_line_numbers_in_errors(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": ["a", "list"]}\n')
    with pytest.raises(ConfigError, match=r"rows.jsonl:3: field 'text' is the list \['a', 'list'\], not a string"):
        load_examples(str(path), byte_tokenizer())
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": 5}]}\n')
    with pytest.raises(ConfigError, match=r"chat.jsonl:1 message 1: field 'content' is the int 5, not a string"):
        load_examples(str(path), byte_tokenizer())
