"""A tiny Qwen2-style causal LM and its tokenizer, built in code from a seed (no downloads).

Saved as a Hugging Face model directory (config.json, model.safetensors, tokenizer.json with a
ChatML chat template), so what DARL's reference server serves is what vLLM could load too.
The tokenizer has one token per character of its alphabet (BPE without merges; printable ASCII
unless the spec names a smaller one); any other character becomes `<|unk|>`.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

UNK = "<|unk|>"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPEC_FILE = "darl_tiny_model.json"

# One token per printable ASCII character (and tab, newline): whatever the model samples is
# readable text, and the vocabulary stays small enough for RL from scratch on a CPU.
ALPHABET = "".join(c for c in string.printable if c not in "\x0b\x0c\r")

# The digits toy task (examples/digits/task.py) needs only these: a 15-token vocabulary makes a
# random policy's answers short and its rewards learnable from scratch in a few thousand samples.
DIGITS_ALPHABET = "0123456789="


class ModelSpecError(ValueError):
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


def build_tokenizer(spec: TinyModelSpec | None = None) -> PreTrainedTokenizerFast:
    """One token per character of the spec's alphabet after `<|unk|>` (id 0), then the special
    tokens; raises ModelSpecError for an empty alphabet or a repeated character."""
    spec = spec or TinyModelSpec()
    characters = spec.characters
    if not characters or len(set(characters)) != len(characters):
        raise ModelSpecError(f"an alphabet needs distinct characters, got {characters!r}")
    vocab = {UNK: 0, **{c: i + 1 for i, c in enumerate(characters)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.decoder = decoders.Fuse()
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
    existing directory made from the same spec is kept as it is)."""
    spec = spec or TinyModelSpec()
    marker = path / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(asdict(spec)))
    return path


def load_model_dir(path: Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer
