"""Training data from local files: tokenization, loss masks, packing and a resumable batch stream.

Formats:

* ``.txt`` -- the whole file is one document; loss on every token.
* ``.jsonl`` / ``.parquet`` -- one example per row: ``{"messages": [{"role", "content"}, ...]}`` (chat,
  rendered with the tokenizer's chat template), ``{"prompt", "response"}`` (chat when the tokenizer has
  a template, else plain concatenation), or ``{<text_field>: ...}`` (plain text). Chat and
  prompt/response rows are trained on the responses only (labels -100 elsewhere).

Every document ends with EOS. With ``pack`` the examples are concatenated into one stream cut into
``seq_len`` rows (no padding, the remainder shorter than a row is dropped); without it each example is
one row, truncated or right-padded. Right padding needs no attention mask in a causal model: real
tokens never attend to later positions, and padded labels are -100.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple

import torch

from roundpipe.cli.config import ConfigError
from roundpipe.cli.tasks import IGNORE_INDEX

logger = logging.getLogger("roundpipe")

Example = Tuple[List[int], List[int]]  # (input_ids, labels)


def _not_utf8(path: str, lineno: int, offset: int, byte: int) -> ConfigError:
    """The error for a byte that is not UTF-8: where it is (line, byte offset of the file), what to do."""
    return ConfigError(
        f"{path}:{lineno} is not valid UTF-8 (byte 0x{byte:02x} at byte offset {offset} of the file)",
        "save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 in.txt > out.txt)",
    )


def read_text(path: str) -> str:
    """A .txt file's text (UTF-8)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.start
    raise _not_utf8(path, raw.count(b"\n", 0, bad) + 1, bad, raw[bad])


def read_rows(path: str) -> List[Tuple[str, Dict[str, Any]]]:
    """Rows of a .jsonl or .parquet file as dicts, each with where it is (``path:line`` for jsonl,
    ``path row N`` for parquet) for error messages."""
    if path.lower().endswith(".jsonl"):
        rows = []
        offset = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise _not_utf8(path, lineno, offset + exc.start, raw[exc.start]) from None
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(
                        f"{path}:{lineno} is not valid JSON ({exc.msg})", "write one JSON object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}:{lineno} is not a JSON object", "write one JSON object per line")
                rows.append((f"{path}:{lineno}", row))
        return rows
    try:
        import datasets

        table = list(datasets.load_dataset("parquet", data_files=path, split="train"))
    except ImportError:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"reading {path} needs the 'datasets' package", "pip install datasets (or convert the file to .jsonl)"
            ) from None
        table = pq.read_table(path).to_pylist()
    return [(f"{path} row {i}", row) for i, row in enumerate(table, 1)]


def _encode(tokenizer: Any, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: List[Dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_segments(tokenizer: Any, messages: List[Dict[str, str]]) -> List[List[Tuple[str, bool]]]:
    """Split a rendered conversation into ``(text, is_response)`` segments, one list per example.

    The conversation is rendered prefix by prefix: the text between ``render(messages[:i],
    add_generation_prompt=True)`` and ``render(messages[:i+1])`` is assistant turn i's response. When
    the template renders earlier turns differently once later turns follow (Qwen3 drops the reasoning
    block of past turns, for example), the rendering is not prefix-stable and each assistant turn
    becomes an example of its own: its context rendered as the template would at inference time.
    """
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        return []
    segments: List[Tuple[str, bool]] = []
    done = ""
    full = _render(tokenizer, messages, False)
    stable = True
    for i in turns:
        prefix = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (prefix.startswith(done) and upto.startswith(prefix) and full.startswith(upto)):
            stable = False
            break
        segments += [(prefix[len(done) :], False), (upto[len(prefix) :], True)]
        done = upto
    if stable:
        return [segments + [(full[len(done) :], False)]]
    per_turn = []
    for i in turns:
        prefix = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not upto.startswith(prefix):
            raise ConfigError(
                "the tokenizer's chat template renders an assistant turn that does not extend its generation prompt",
                "use prompt/response rows or a tokenizer whose chat template adds the generation prompt as a prefix",
            )
        per_turn.append([(prefix, False), (upto[len(prefix) :], True)])
    return per_turn


def _from_segments(tokenizer: Any, segments: Sequence[Tuple[str, bool]], add_eos: bool) -> Example:
    ids: List[int] = []
    labels: List[int] = []
    for text, train in segments:
        if not text:
            continue
        t = _encode(tokenizer, text)
        ids += t
        labels += t if train else [IGNORE_INDEX] * len(t)
    if add_eos and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id if any(train for _, train in segments) else IGNORE_INDEX)
    return ids, labels


#: Chat roles the usual templates know; rows with others are likely another dataset's convention.
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer")


def _string(row: Dict[str, Any], field: str, where: str) -> str:
    """``row[field]``, which must be a string: a number or null would be trained on as '0' / 'None'."""
    value = row[field]
    if not isinstance(value, str):
        kind = "null" if value is None else f"the {type(value).__name__} {value!r}"
        raise ConfigError(
            f"{where}: field '{field}' is {kind}, not a string", f"write '{field}' as a JSON string, or drop the row"
        )
    return value


def row_examples(row: Dict[str, Any], tokenizer: Any, text_field: str, where: str) -> List[Example]:
    """Examples of one jsonl/parquet row (chat, prompt/response or plain text); none for a chat row
    without an assistant turn (see :func:`load_examples`)."""
    if "messages" in row:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"{where} has chat messages but the tokenizer has no chat template",
                "use a tokenizer with a chat_template, or prompt/response rows",
            )
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ConfigError(f"{where}: 'messages' is not a list of {{role, content}} objects", "fix the row")
        for i, m in enumerate(messages):
            _string(m, "role", f"{where} message {i + 1}")
            _string(m, "content", f"{where} message {i + 1}")
        return [_from_segments(tokenizer, seg, add_eos=False) for seg in chat_segments(tokenizer, messages)]
    if "prompt" in row and "response" in row:
        prompt, response = _string(row, "prompt", where), _string(row, "response", where)
        if getattr(tokenizer, "chat_template", None):
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return [_from_segments(tokenizer, seg, add_eos=False) for seg in chat_segments(tokenizer, msgs)]
        return [_from_segments(tokenizer, [(prompt, False), (response, True)], add_eos=True)]
    if text_field in row:
        return [_from_segments(tokenizer, [(_string(row, text_field, where), True)], add_eos=True)]
    raise ConfigError(
        f"{where} has none of the fields 'messages', 'prompt'+'response' or '{text_field}' (it has {sorted(row)})",
        "rename the field, or set --text-field to the field holding the text",
    )


def load_examples(path: str, tokenizer: Any, text_field: str = "text") -> List[Example]:
    """Tokenized examples of a .txt, .jsonl or .parquet file.

    Chat rows without an ``assistant`` turn have nothing to train on and are dropped, with a warning
    that says how many and which roles they use; if that leaves nothing, it is an error saying so.
    """
    if path.lower().endswith(".txt"):
        text = read_text(path)
        if not text:
            raise ConfigError(f"{path} is empty", "put the training text in it")
        return [_from_segments(tokenizer, [(text, True)], add_eos=True)]
    examples: List[Example] = []
    rows = read_rows(path)
    dropped = 0
    roles: Set[str] = set()
    for where, row in rows:
        found = row_examples(row, tokenizer, text_field, where)
        if not found:  # a chat row without an assistant turn
            dropped += 1
            roles.update(m["role"] for m in row["messages"])
        examples += found
    if not rows:
        raise ConfigError(f"{path} has no rows", "add one JSON object per line (text, prompt/response or messages)")
    if dropped:
        unknown = sorted(r for r in roles if r not in KNOWN_ROLES)
        why = (
            f"{dropped} of {len(rows)} rows have chat messages without an 'assistant' turn (roles found: "
            f"{', '.join(sorted(roles)) or 'none'})"
        )
        fix = (
            f"rename the roles {', '.join(repr(r) for r in unknown)} to user/assistant"
            if unknown
            else "give each conversation at least one assistant turn to train on"
        )
        if not examples:
            raise ConfigError(f"{path} holds no training examples: {why}", fix)
        logger.warning("%s: %s; they were dropped — %s", path, why, fix)
    return examples


def pack_examples(examples: Iterable[Example], seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenate examples and cut the stream into ``[N, seq_len]`` rows (remainder dropped)."""
    ids: List[int] = []
    labels: List[int] = []
    for x, y in examples:
        ids += x
        labels += y
    n = len(ids) // seq_len
    if n == 0:
        raise ConfigError(
            f"the data has {len(ids)} tokens, fewer than one sequence of seq_len={seq_len}",
            f"lower --seq-len below {len(ids)} or add data",
        )
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len), torch.tensor(labels[: n * seq_len]).view(n, seq_len)


def pad_examples(examples: Sequence[Example], seq_len: int, pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One row per example, truncated to ``seq_len`` or right-padded (labels -100 on padding)."""
    if not examples:
        raise ConfigError("the data file has no examples", "add rows to it")
    truncated = sum(len(x) > seq_len for x, _ in examples)
    if truncated:
        logger.warning(
            "%d of %d examples are longer than seq_len=%d and were truncated", truncated, len(examples), seq_len
        )
    ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        n = min(len(x), seq_len)
        ids[i, :n] = torch.tensor(x[:n])
        labels[i, :n] = torch.tensor(y[:n])
    return ids, labels


class FileStream:
    """Shuffled batches of fixed-length rows, epoch after epoch.

    Each epoch is a permutation drawn from ``seed`` and the epoch number, so the data position is just
    ``(epoch, offset)``: a resumed run continues with exactly the batches the uninterrupted run draws.
    """

    def __init__(
        self, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int, seed: int, description: str
    ) -> None:
        if not (labels != IGNORE_INDEX).any():
            raise ConfigError(
                "no token of the data is trained on (every label is masked)", "check that rows have responses or text"
            )
        if batch_size > input_ids.shape[0]:
            raise batch_too_large(batch_size, input_ids.shape[0], description)
        self.input_ids, self.labels = input_ids, labels
        self.batch_size = batch_size
        self.seed = seed
        self.epoch, self.offset = 0, 0
        self._description = description
        self._perm = self._permutation(0)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        rows: List[torch.Tensor] = []
        need = self.batch_size
        while need:
            take = self._perm[self.offset : self.offset + need]
            rows.append(take)
            need -= take.numel()
            self.offset += take.numel()
            if self.offset >= self.num_rows:
                self.epoch, self.offset = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        idx = torch.cat(rows)
        return self.input_ids[idx], self.labels[idx]

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._perm = self._permutation(self.epoch)

    def describe(self) -> str:
        return self._description


def batch_too_large(batch_size: int, rows: int, description: str) -> ConfigError:
    """A batch of more rows than the data has: refused, as Hugging Face's Trainer never repeats a row within a
    batch; here each row would be in every batch about ``batch_size / rows`` times."""
    what = f"batch_size={batch_size} is more than the {rows} row(s) of the data"
    if description:
        what += f" ({description})"
    what += f": every batch would hold each row {batch_size / rows:.1f} times on average"
    return ConfigError(what, f"lower --batch-size to at most {rows}, or give more data (or a shorter --seq-len)")


def file_stream(
    path: str, tokenizer: Any, seq_len: int, pack: bool, batch_size: int, seed: int, text_field: str = "text"
) -> FileStream:
    """Load, tokenize and pack (or pad) a data file into a :class:`FileStream`."""
    examples = load_examples(path, tokenizer, text_field)
    if pack:
        ids, labels = pack_examples(examples, seq_len)
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids, labels = pad_examples(examples, seq_len, pad if pad is not None else 0)
    trained = int((labels != IGNORE_INDEX).sum())
    desc = (
        f"{os.path.basename(path)}: {len(examples)} examples -> {ids.shape[0]} rows x {seq_len} tokens "
        f"({'packed' if pack else 'padded'}, {trained} trained tokens)"
    )
    return FileStream(ids, labels, batch_size, seed, desc)


__all__ = [
    "FileStream",
    "batch_too_large",
    "chat_segments",
    "file_stream",
    "load_examples",
    "pack_examples",
    "pad_examples",
    "read_rows",
    "read_text",
    "row_examples",
]
