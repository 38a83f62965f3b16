"""A tiny Qwen2-style causal LM and its tokenizer, built in code from a seed (no downloads).

Saved as a Hugging Face model directory (config.json, model.safetensors, tokenizer.json with a
ChatML chat template), so what DARL's reference server serves is what vLLM could load too.
The tokenizer has one token per character of its alphabet (byte-level BPE without merges;
printable ASCII unless the spec names a smaller one); each byte of any other character becomes
`<|unk|>`.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from darl.serving.errors import ServingError

UNK = "<|unk|>"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, and function tools as Hermes / Qwen2.5 write them: the tools' signatures in the system
# block, an assistant's calls as `<tool_call>` JSON after its content (no separator, so a call the
# model generated renders back as the same characters), tool results in a user block. Messages
# without tools or tool calls render as plain ChatML, byte for byte (trained toy tasks depend
# on those bytes). A tool is rendered field by field, not with `tool | tojson`: vLLM passes
# `tool.model_dump()` (with `"description": null` and more) where a client sent less.
# Call arguments: a string (OpenAI's form) verbatim, an object (vLLM parses the string into one)
# with `tojson`, which gives the same bytes for canonical JSON (", " and ": ").
CHAT_TEMPLATE = (
    # No whitespace control (`-`) and no newline right after a `%}` (HF's jinja trims it):
    # every character outside the tags below is output as written.
    "{% macro render_tool(tool) %}"
    "{% set f = tool['function'] if tool['function'] is defined else tool %}"
    '{"type": "function", "function": {"name": {{ f["name"] | tojson }}'
    "{% if f['description'] is defined and f['description'] is not none %}"
    ', "description": {{ f["description"] | tojson }}'
    "{% endif %}"
    "{% if f['parameters'] is defined and f['parameters'] is not none %}"
    ', "parameters": {{ f["parameters"] | tojson }}'
    "{% endif %}"
    "{{ '}}' }}"
    "{% endmacro %}"
    "{% set ns = namespace(first=0) %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.first = 1 %}"
    "{{ messages[0]['content'] }}\n\n"
    "{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ render_tool(tool) }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages[ns.first:] %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['tool_calls'] is defined and message['tool_calls'] %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set c = call['function'] if call['function'] is defined else call %}"
    "<tool_call>{{ '\\n' }}"
    '{"name": {{ c["name"] | tojson }}, "arguments": '
    "{% if c['arguments'] is string %}{{ c['arguments'] }}"
    "{% else %}{{ c['arguments'] | tojson }}{% endif %}"
    "{{ '}' }}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPEC_FILE = "darl_tiny_model.json"
# Bumped when the tokenizer files change for the same spec (2: byte-level vocabulary names).
TOKENIZER_FORMAT = 2

# One token per printable ASCII character (and tab, newline): whatever the model samples is
# readable text, and the vocabulary stays small enough for RL from scratch on a CPU.
ALPHABET = "".join(c for c in string.printable if c not in "\x0b\x0c\r")

# The digits toy task (examples/digits/task.py) needs only these: a 15-token vocabulary makes a
# random policy's answers short and its rewards learnable from scratch in a few thousand samples.
DIGITS_ALPHABET = "0123456789="


class ModelSpecError(ServingError, ValueError):
    """A model spec that cannot be built (an empty alphabet, a repeated character)."""


@dataclass(frozen=True)
class TinyModelSpec:
    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    alphabet: str | None = None  # None: printable ASCII (ALPHABET)

    @property
    def characters(self) -> str:
        return ALPHABET if self.alphabet is None else self.alphabet


MODEL_PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "digits": TinyModelSpec(alphabet=DIGITS_ALPHABET),
    # vLLM's CPU attention takes head sizes 32, 64, 80, ... (not tiny's 16): 2 heads of 32;
    # and a context long enough for a call that lasts seconds at vLLM's speed on a CPU.
    "vllm": TinyModelSpec(
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192
    ),
}


def _byte_level_names() -> dict[str, str]:
    """GPT-2's byte-to-unicode table for ASCII: how a byte-level BPE vocabulary spells each
    character (`Ġ` for a space, `Ċ` for a newline, a printable character as itself)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    names, extra = {}, 0
    for byte in range(128):
        if byte in printable:
            names[chr(byte)] = chr(byte)
        else:
            names[chr(byte)] = chr(256 + extra)
        extra += byte not in printable
    return names


def build_tokenizer(spec: TinyModelSpec | None = None) -> PreTrainedTokenizerFast:
    """One token per character of the spec's alphabet after `<|unk|>` (id 0), then the special
    tokens; raises ModelSpecError for an empty alphabet or a repeated character.

    The vocabulary is byte-level (a space is the token `Ġ`), as Qwen2's is: transformers loads
    a `qwen2` model directory with its own Qwen2Tokenizer, whose byte-level pre-tokenizer would
    drop every whitespace character of a vocabulary that spells them raw (vLLM would see
    "What is 3 + 4?" as "Whatis3+4?"). A character's id is its place in the alphabet whatever
    name spells it, so the byte-level names change no id."""
    spec = spec or TinyModelSpec()
    characters = spec.characters
    if not characters or len(set(characters)) != len(characters):
        raise ModelSpecError(f"an alphabet needs distinct characters, got {characters!r}")
    if any(ord(c) > 127 for c in characters):
        raise ModelSpecError(f"an alphabet holds ASCII characters only, got {characters!r}")
    names = _byte_level_names()
    vocab = {UNK: 0, **{names[c]: i + 1 for i, c in enumerate(characters)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([UNK, *SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"{token!r} is not one token of the tiny tokenizer")
    return token_id


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=_token_id(tokenizer, ENDOFTEXT),
        eos_token_id=_token_id(tokenizer, IM_END),
        pad_token_id=_token_id(tokenizer, ENDOFTEXT),
        # transformers' typed signature lacks the kwarg its configs still take.
        torch_dtype="float32",  # type: ignore[call-arg]
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config).eval()


def create_model_dir(path: Path, spec: TinyModelSpec | None = None) -> Path:
    """Build the tiny model and tokenizer from `spec` and save them to `path` (idempotent: an
    existing directory made from the same spec keeps its weights; one whose chat template or
    tokenizer files are not today's gets today's, so a cached directory never serves old ones)."""
    spec = spec or TinyModelSpec()
    marker = path / SPEC_FILE
    recorded = json.loads(marker.read_text()) if marker.exists() else None
    wanted = {**asdict(spec), "chat_template": CHAT_TEMPLATE, "tokenizer": TOKENIZER_FORMAT}
    if recorded == wanted:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    same_spec = recorded is not None and {
        k: v for k, v in recorded.items() if k not in ("chat_template", "tokenizer")
    } == asdict(spec)
    if not same_spec:
        build_model(spec, tokenizer).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(wanted))
    return path


def load_model_dir(path: Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer
