"""Task tokenizer: hand-computed ids, round trips, and equality with transformers' AutoTokenizer."""

import random
import string

import pytest
import transformers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from models.tokenizer import build_task_tokenizer, load_tokenizer

SPECIAL_IDS = {
    "<pad>": 0,
    "<eos>": 1,
    "<|im_start|>": 2,
    "<|im_end|>": 3,
    "<tool_call>": 4,
    "</tool_call>": 5,
    "<tool_response>": 6,
    "</tool_response>": 7,
    "<answer>": 8,
    "</answer>": 9,
    "<unk>": 10,
}
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"


def char_id(c: str) -> int:
    """Hand-computed id of a character: printable ASCII from 11 on, then newline at 106."""
    return 106 if c == "\n" else 11 + ord(c) - 32


TEXTS = [
    "12+34=<answer>46</answer>",
    "  leading and trailing spaces  ",
    "a\nb\n\nc",
    "<tool_call>123*45+678</tool_call><tool_response>6213</tool_response><answer>6213</answer>",
    "<answer<answer>>",  # a tag inside broken tags
    "[19,36,55,7]->65:<answer>(19+36)*(55-7)</answer>",
    PRINTABLE,
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_task_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_vocab_layout(tok):
    assert tok.vocab_size == 107 <= 128
    for t, i in SPECIAL_IDS.items():
        assert tok.token_id(t) == i
    assert tok.pad_id == 0 and tok.eos_id == 1
    assert tok.encode(PRINTABLE) == [char_id(c) for c in PRINTABLE]
    with pytest.raises(KeyError, match="<bos>"):
        tok.token_id("<bos>")


def test_char_by_char_and_tags_are_one_token(tok):
    assert tok.encode("12+34=") == [char_id(c) for c in "12+34="]
    assert tok.encode("<answer>46</answer>") == [8, char_id("4"), char_id("6"), 9]
    assert tok.encode("x<eos>") == [char_id("x"), 1]
    # Near-miss tags are plain characters.
    assert tok.encode("<answer >") == [char_id(c) for c in "<answer >"]


def test_round_trip(tok):
    rng = random.Random(0)
    alphabet = PRINTABLE + "".join(SPECIAL_IDS)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    for _ in range(200):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert tok.decode(tok.encode(s)) == s


def test_skip_special_drops_control_keeps_tags(tok):
    ids = tok.encode("<|im_start|>a<answer>1</answer><eos><pad>")
    assert tok.decode(ids, skip_special=True) == "a<answer>1</answer>"


def test_non_ascii_becomes_unk_without_crash(tok):
    assert tok.encode("é\t漢") == [10, 10, 10]


def test_transformers_loads_same_ids(tok, hf_tok):
    assert isinstance(hf_tok, transformers.PreTrainedTokenizerFast)
    assert hf_tok.eos_token_id == 1 and hf_tok.pad_token_id == 0
    assert len(hf_tok) == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok.encode(text) == ids
        assert hf_tok.encode(text, add_special_tokens=False) == ids
        assert hf_tok.decode(ids, skip_special_tokens=False) == text
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special=True)
    # The incremental detokenization path vLLM uses.
    ids = tok.encode(TEXTS[3] + "<eos>")
    assert hf_tok.convert_tokens_to_string(hf_tok.convert_ids_to_tokens(ids)) == tok.decode(ids)
    stream, out = decoders.DecodeStream(skip_special_tokens=False), ""
    for i in ids:
        out += stream.step(tok.backend, i) or ""
    assert out == TEXTS[3] + "<eos>"


CHATS = [
    [{"role": "user", "content": "12+34="}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "123*45+678="},
        {"role": "assistant", "content": "<tool_call>123*45+678</tool_call>"},
        {"role": "tool", "content": "<tool_response>6213</tool_response>"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, add_generation_prompt):
    for messages in CHATS:
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert ours == list(theirs)
    # ChatML written out by hand.
    text = tok.decode(tok.apply_chat_template(CHATS[0], add_generation_prompt=True))
    assert text == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"


def test_load_tokenizer_on_another_hf_dir(tmp_path):
    """A byte-level BPE tokenizer with a BOS and a template that uses bos_token."""
    backend = BackendTokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([string.ascii_letters * 3, "hello world " * 20], trainer)
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template=template
    )
    hf.save_pretrained(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(str(tmp_path))
    assert ours.eos_id == hf.eos_token_id and ours.pad_id is None
    msgs = [{"role": "user", "content": "hello world"}]
    theirs = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ours.apply_chat_template(msgs) == list(theirs)
    assert ours.encode("hello world") == hf.encode("hello world", add_special_tokens=False)


def test_load_tokenizer_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
