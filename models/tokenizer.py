"""Tokenizers: load any local HF tokenizer dir fast; build the tiny character-level task tokenizer.

The task tokenizer maps every printable ASCII character and "\\n" to its own token, plus a few
special tokens (chat and tool/answer tags, each ONE token wherever it appears in text). It is a
plain `tokenizer.json` that `transformers.AutoTokenizer` (PreTrainedTokenizerFast) and vLLM load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

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
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in CONTROL_TOKENS or t == UNK,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special_map, f, indent=2)
    return out_dir


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass
class Tokenizer:
    """A local HF tokenizer (tokenizer.json) with its special tokens and chat template."""

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]  # e.g. {"eos_token": "<eos>", "pad_token": "<pad>"}
    chat_template: str | None

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
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(self.chat_template)
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


def load_tokenizer(path: str) -> Tokenizer:
    """Loads a local HF tokenizer directory (needs tokenizer.json) without transformers."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}; a fast HF tokenizer dir is needed")
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
    return Tokenizer(backend=backend, special_tokens=special, chat_template=template)
