"""Tokenizers: load any local HF tokenizer dir fast; build the tiny character-level task tokenizer
and small byte-level BPE tokenizers with a Qwen-style chat template (tests, the demonstration).

The task tokenizer maps every printable ASCII character and "\\n" to its own token, plus a few
special tokens (chat and tool/answer tags, each ONE token wherever it appears in text). It is a
plain `tokenizer.json` that `transformers.AutoTokenizer` (PreTrainedTokenizerFast) and vLLM load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable
from datetime import datetime

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

PAD = "<pad>"
EOS = "<eos>"
UNK = "<unk>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
ANSWER, ANSWER_END = "<answer>", "</answer>"

# Control tokens: never part of task text; dropped by decode(skip_special=True).
CONTROL_TOKENS = (PAD, EOS, IM_START, IM_END)
# Tag tokens: matched as one token in text and kept by decode(skip_special=True) (as Qwen does).
TAG_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, ANSWER, ANSWER_END)
# Vocabulary order: pad=0, eos=1, then the chat and tag tokens, then unk, then the characters.
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, *TAG_TOKENS, UNK)
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def task_vocab() -> dict[str, int]:
    """The task tokenizer's token -> id map (special tokens first, then characters)."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def _build_backend() -> tokenizers.Tokenizer:
    vocab = task_vocab()
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (newline included) is its own pre-token; no normalizer, no merges.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate tokens, no inserted spaces
    control = {PAD, EOS, IM_START, IM_END, UNK}
    tok.add_tokens(
        [
            AddedToken(t, special=t in control, normalized=False, lstrip=False, rstrip=False)
            for t in SPECIAL_TOKENS
        ]
    )
    return tok


def build_task_tokenizer(out_dir: str, *, model_max_length: int = 2048) -> str:
    """Writes the character-level task tokenizer (tokenizer.json + configs) to out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    backend = _build_backend()
    vocab = task_vocab()
    if backend.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise RuntimeError(
            f"task tokenizer has {backend.get_vocab_size(with_added_tokens=True)} tokens, "
            f"expected {len(vocab)}"
        )
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    special_map = {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    specials = {vocab[t]: (t, t in CONTROL_TOKENS or t == UNK) for t in SPECIAL_TOKENS}
    write_config(out_dir, specials, special_map, CHATML_TEMPLATE, model_max_length)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special_map, f, indent=2)
    return out_dir


def write_config(
    out_dir: str, specials: dict, names: dict, template: str, model_max_length: int
) -> None:
    """tokenizer_config.json of a fast tokenizer: `specials` {id: (content, special)} as its
    added tokens, `names` (eos_token, ...), the chat template; no BOS or EOS added."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (t, special) in specials.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        **names,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass
class Tokenizer:
    """A local HF tokenizer (tokenizer.json) with its special tokens and chat template.

    `end_ids` are the tokens that end an episode, the first the one a demonstration ends
    with: eos and generation_config.json's eos ids (and, via with_turn_end, the chat
    template's end-of-turn token).
    """

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]  # e.g. {"eos_token": "<eos>", "pad_token": "<pad>"}
    chat_template: str | None
    end_ids: tuple[int, ...] = ()
    path: str = ""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        """Id of the eos token, or None if the directory names none."""
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        """Id of the pad token, or None if the directory names none."""
        return self._special_id("pad_token")

    def _special_id(self, key: str) -> int | None:
        tok = self.special_tokens.get(key)
        return None if tok is None else self.token_id(tok)

    def with_turn_end(self) -> Tokenizer:
        """This tokenizer with its chat template's end-of-turn token first in end_ids (the
        token a rendered assistant message ends with: `<|im_end|>` for ChatML)."""
        eot = self.turn_end_id()
        rest = tuple(i for i in self.end_ids if i != eot)
        return dataclasses.replace(self, end_ids=(eot, *rest))

    def turn_end_id(self) -> int:
        """The special token the chat template writes right after an assistant message."""
        marker = "\x00TANDEM\x00"
        text = self.render_chat(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
            add_generation_prompt=False,
        )
        after = text.partition(marker)[2]
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        for tok in sorted(added, key=len, reverse=True):
            if after.startswith(tok):
                return self.token_id(tok)
        raise ValueError(
            f"the chat template of {self.path or 'this tokenizer'} writes {after[:20]!r} after "
            "an assistant message, not a special token: no end-of-turn token to stop on"
        )

    def token_id(self, tok: str) -> int:
        """The id of one token string; raises KeyError naming it if absent."""
        i = self.backend.token_to_id(tok)
        if i is None:
            raise KeyError(f"token {tok!r} is not in the vocabulary ({self.vocab_size} tokens)")
        return i

    def encode(self, text: str) -> list[int]:
        """Token ids of text (no BOS/EOS added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of token ids; skip_special drops control tokens (pad, eos, chat markers)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered to text, as transformers renders it."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        template = _compiled_template(self.chat_template)
        return template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat (same ids as transformers' apply_chat_template)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
    """The chat template compiled once per source, in transformers' sandboxed environment
    (compiling is most of a render's time)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(path: str) -> Tokenizer:
    """Loads a local HF tokenizer directory (needs tokenizer.json) without transformers."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(
            f"{tok_file} does not exist; a fast HF tokenizer (tokenizer.json) is needed"
        )
    backend = tokenizers.Tokenizer.from_file(tok_file)
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p) as f:
                config.update(json.load(f))
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(config.get(key))
        if content is not None:
            special[key] = content
    template = config.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            template = f.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    tok = Tokenizer(backend=backend, special_tokens=special, chat_template=template, path=path)
    ends = [tok.eos_id] + _generation_eos(path)
    tok.end_ids = tuple(dict.fromkeys(int(i) for i in ends if i is not None))
    return tok


def _generation_eos(path: str) -> list[int]:
    """eos ids of the directory's generation_config.json (an int or a list), if any."""
    p = os.path.join(path, "generation_config.json")
    if not os.path.isfile(p):
        return []
    with open(p) as f:
        ids = json.load(f).get("eos_token_id")
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


# Qwen2's pre-tokenizer: words, single digits, punctuation runs, newlines, spaces.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT = "<|endoftext|>"
# Qwen2.5's template without its tool-calling branches is plain ChatML: the task tokenizer's.
QWEN_CHAT_TEMPLATE = CHATML_TEMPLATE


def build_bpe_tokenizer(out_dir: str, corpus: Iterable[str], *, vocab_size: int = 512) -> str:
    """Trains a byte-level BPE tokenizer on `corpus` with Qwen2's pre-tokenizer (digits split
    one by one), ChatML special tokens and a Qwen-style chat template; writes it as an HF
    tokenizer directory (eos `<|endoftext|>`, the chat's end of turn `<|im_end|>`)."""
    os.makedirs(out_dir, exist_ok=True)
    special = [ENDOFTEXT, IM_START, IM_END]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    specials = {tok.token_to_id(t): (t, True) for t in special}
    names = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT}
    write_config(out_dir, specials, names, QWEN_CHAT_TEMPLATE, 2048)
    return out_dir
