"""The built-in default: a byte-level tokenizer and synthetic tasks generated on the fly.

The default run (``roundpipe train`` with no arguments) trains a small Qwen3 model from scratch on one
of these tasks and reports exact-match accuracy on held-out examples, so a fresh machine can check the
whole stack (runtime, optimizer, checkpoints, metrics) in a few minutes without downloading anything.

Every example is ``prompt + answer + EOS`` where the prompt and the answer have a fixed length per task,
so a batch needs no padding and greedy decoding of a whole batch runs in lock step. Held-out examples
are chosen by a hash of the problem, never by position, so they are never trained on, whatever the
seed or the number of steps.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

# torch is imported where it is used: config validation reads TASKS, and configuration errors must
# answer before torch would have loaded.
if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100

#: Special tokens of the byte tokenizer; ids 256.. in this order (byte b has id b).
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

#: ChatML, so chat-formatted jsonl data also works with the built-in tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer():
    """A byte-level ``PreTrainedTokenizerFast``: token id = byte value, specials from 256.

    A ByteLevel BPE with the 256 byte symbols and no merges, built in code, so ``save_pretrained`` /
    ``AutoTokenizer.from_pretrained`` round-trip offline and any text (any language) is encodable.
    """
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
EOS_ID = 256


@dataclass(frozen=True)
class Task:
    """A synthetic task: ``sample(gen)`` draws one problem as ``(prompt, answer)`` strings.

    Attributes:
        name: The ``task`` config value.
        description: One line for ``--help`` and the docs.
        prompt_len: Bytes in every prompt.
        answer_len: Bytes in every answer (EOS follows).
        sample: Draws a random problem with a ``torch.Generator``.
        at_length: For tasks whose examples can be any length (``recall``): the task with examples of
            ``n`` tokens, for ``--seq-len n``; None for fixed-length tasks.
    """

    name: str
    description: str
    prompt_len: int
    answer_len: int
    sample: Callable[[torch.Generator], Tuple[str, str]]
    at_length: Optional[Callable[[int], "Task"]] = None

    @property
    def seq_len(self) -> int:
        """Tokens of one example: prompt, answer and EOS."""
        return self.prompt_len + self.answer_len + 1


def _randint(gen: torch.Generator, high: int) -> int:
    import torch

    return int(torch.randint(high, (1,), generator=gen))


def _addition(digits: int, lsb_first: bool = False) -> Task:
    """``a+b=`` with zero-padded operands; the sum has ``digits + 1`` digits, most significant first
    (or least significant first with ``lsb_first``: the order in which carries are computed, which a
    small model learns much faster)."""

    def sample(gen: torch.Generator) -> Tuple[str, str]:
        a, b = _randint(gen, 10**digits), _randint(gen, 10**digits)
        answer = f"{a + b:0{digits + 1}d}"
        return f"{a:0{digits}d}+{b:0{digits}d}=", answer[::-1] if lsb_first else answer

    x, y = int("1" * digits), int("2" * digits) + 10 ** (digits - 1) * 7
    example = f"{x + y:0{digits + 1}d}"
    name = ("addition" if digits == 3 else f"addition{digits}") + ("-lsb" if lsb_first else "")
    order = ", sum written least significant digit first" if lsb_first else ""
    return Task(
        name,
        f"{digits}-digit addition{order}: '{x}+{y}=' -> '{example[::-1] if lsb_first else example}'",
        2 * digits + 2,
        digits + 1,
        sample,
    )


def _reverse(length: int) -> Task:
    letters = "abcdefghijklmnopqrstuvwxyz"

    def sample(gen: torch.Generator) -> Tuple[str, str]:
        s = "".join(letters[_randint(gen, len(letters))] for _ in range(length))
        return f"{s}>", s[::-1]

    return Task("reverse", f"reverse a {length}-letter string, e.g. 'abcdef>' -> 'fedcba'", length + 1, length, sample)


KEY_LEN = 1
RECALL_MIN_LEN = 32


def _recall(seq_len: int) -> Task:
    """Long-context recall: ``key=Q;`` at the start, filler up to ``seq_len``, then ``?``; the answer is the
    key. The filler (random lowercase letters and spaces) says nothing about the key, so the model can
    only answer by attending from the end of the context back to its start, across all of it. Held-out
    problems are new contexts (the filler is random: nothing to memorise)."""
    if seq_len < RECALL_MIN_LEN:
        raise ValueError(f"the recall task needs seq_len >= {RECALL_MIN_LEN}, got {seq_len}")
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    head = len("key=") + KEY_LEN + 1
    filler_len = seq_len - head - 1 - KEY_LEN - 1  # "?" + answer + EOS
    words = "abcdefghijklmnopqrstuvwxyz "

    def sample(gen: torch.Generator) -> Tuple[str, str]:
        import torch

        key = "".join(letters[_randint(gen, len(letters))] for _ in range(KEY_LEN))
        filler = "".join(words[i] for i in torch.randint(len(words), (filler_len,), generator=gen).tolist())
        return f"key={key};{filler}?", key

    return Task(
        "recall",
        f"recall the key letter given at the start of a {seq_len}-token context: 'key=Q;<filler>?' -> 'Q' "
        "(--seq-len sets the context)",
        seq_len - KEY_LEN - 1,
        KEY_LEN,
        sample,
        _recall,
    )


TASKS: Dict[str, Task] = {
    t.name: t
    for t in (
        _addition(3),
        _addition(3, True),
        _addition(2),
        _addition(4),
        _addition(4, True),
        _reverse(6),
        _recall(128),
    )
}


def task_for(name: str, seq_len: Optional[int]) -> Task:
    """Task ``name`` for ``--seq-len seq_len`` (None: its own length); a fixed-length task with another
    length raises ValueError."""
    task = TASKS[name]
    if seq_len is None or seq_len == task.seq_len:
        return task
    if task.at_length is None:
        raise ValueError(f"seq_len={seq_len} is set, but task {name!r} has fixed {task.seq_len}-token examples")
    return task.at_length(seq_len)


def is_held_out(prompt: str) -> bool:
    """Whether a problem belongs to the held-out split (about 1 in 10, by a hash of the prompt)."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def encode_example(prompt: str, answer: str) -> Tuple[List[int], List[int]]:
    """Token ids and labels of one example; only the answer and EOS are trained on."""
    p, a = list(prompt.encode()), list(answer.encode()) + [EOS_ID]
    return p + a, [IGNORE_INDEX] * len(p) + a


class TaskStream:
    """Endless training batches of a task, drawn from a seeded generator (held-out problems skipped).

    The generator's state is the data position: ``state_dict`` / ``load_state_dict`` let a resumed run
    draw exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, task: Task, batch_size: int, seed: int) -> None:
        self.task = task
        import torch

        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.examples_drawn = 0

    @property
    def seq_len(self) -> int:
        return self.task.seq_len

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, each ``[batch_size, seq_len]``."""
        import torch

        ids, labels = [], []
        while len(ids) < self.batch_size:
            prompt, answer = self.task.sample(self.gen)
            if is_held_out(prompt):
                continue
            x, y = encode_example(prompt, answer)
            ids.append(x)
            labels.append(y)
        self.examples_drawn += self.batch_size
        return torch.tensor(ids), torch.tensor(labels)

    def state_dict(self) -> Dict[str, object]:
        return {"generator": self.gen.get_state(), "examples_drawn": self.examples_drawn}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.gen.set_state(state["generator"])  # type: ignore[arg-type]
        self.examples_drawn = int(state["examples_drawn"])  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"task {self.task.name!r}: {self.task.description}"


def held_out_examples(task: Task, n: int, seed: int = 1234) -> List[Tuple[str, str]]:
    """``n`` distinct held-out problems (never trained on)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seen: Dict[str, str] = {}
    for _ in range(10_000 * max(n, 1)):
        if len(seen) >= n:
            break
        prompt, answer = task.sample(gen)
        if is_held_out(prompt):
            seen.setdefault(prompt, answer)
    return list(seen.items())


def exact_match(
    predict_next: Callable[[torch.Tensor], torch.Tensor],
    task: Task,
    examples: List[Tuple[str, str]],
    batch_size: int = 256,
) -> Tuple[float, List[Tuple[str, str, str]]]:
    """Greedy-decode each prompt's answer and compare it with the reference.

    Args:
        predict_next: ``input_ids [B, T] -> logits of the last position [B, V]``.
        examples: ``(prompt, answer)`` pairs.

    Returns:
        ``(accuracy, [(prompt, expected, predicted)])`` for all examples.
    """
    import torch

    results = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        ids = torch.tensor([list(p.encode()) for p, _ in chunk])
        for _ in range(task.answer_len):
            with torch.no_grad():
                nxt = predict_next(ids).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
        for (prompt, answer), row in zip(chunk, ids[:, task.prompt_len :].tolist()):
            pred = "".join(chr(b) if b < 128 else "?" for b in row)  # tasks are ASCII; '?' = any other token
            results.append((prompt, answer, pred))
    acc = sum(a == p for _, a, p in results) / max(len(results), 1)
    return acc, results
