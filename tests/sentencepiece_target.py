"""A hold-out style target: a tiny random Llama with a SentencePiece-style tokenizer and a
Mistral-style `[INST] ... [/INST]` chat template without `{% generation %}` markers.

The demo targets share one byte-level BPE tokenizer (Qwen style) and ChatML templates, so
the token-exactness of on-policy rows is only ever exercised on that family. Mistral's
and Llama-2's tokenizers work differently: `▁` marks word starts (Metaspace), characters
outside the vocabulary fall back to `<0xNN>` byte pieces, the decoder strips the leading
space of a decoded text, and the template glues the reply straight onto `[/INST]` and
ends it with `</s>` — a plain-text tag and an end-of-sequence token instead of ChatML's
special turn markers. Nothing can be downloaded here, so the tokenizer is trained
locally with the `tokenizers` library (a dependency of transformers) and laid out like
Llama-2's: `<unk>`, `<s>`, `</s>`, the 256 byte pieces, then the learned pieces. The
corpus is generic English generated from a seed and deliberately lacks some characters
the demo datasets use (`*`, `+`, `=`, `'`, `?`), so those go through byte fallback, as
rare characters do with a real checkpoint's tokenizer. The tags tokenize as in Llama-2
(`[`, `INST`, `]`), and `]` merges with a following `.` or `,`, so a reply glued to
`[/INST]` can merge with the prompt when re-tokenized.

The checkpoint is written with `save_pretrained`; transformers loads it as
`LlamaForCausalLM` + `LlamaTokenizerFast` and vLLM serves it (head_dim 32: vLLM's CPU
attention needs head sizes of at least 32). It ships a `tokenizer.json`; for a target
that ships only a SentencePiece `tokenizer.model`, as older Llama/Mistral checkpoints do
(transformers converts it on load), `write_sentencepiece_model_target` trains a real one
with the `sentencepiece` library.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaTokenizerFast

from mm_assets.demo.target import random_model

__all__ = [
    "INST_CHAT_TEMPLATE",
    "build_sentencepiece_target",
    "sentencepiece_tokenizer",
    "write_sentencepiece_model_target",
]

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
BYTE_PIECES: tuple[str, ...] = tuple(f"<0x{b:02X}>" for b in range(256))
VOCAB_SIZE = 1024  # trained size: 3 specials, 256 byte pieces, learned pieces (see below)
VOCAB_MULTIPLE = 64

# Mistral-7B-Instruct-v0.2's template (reply glued to `[/INST]`, closed by `</s>`), with
# a system turn folded into the first user turn as Llama-2 does. No generation markers:
# tokenization falls back to the prefix-render loss mask.
INST_CHAT_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' -%}
    {%- set system_message = messages[0]['content'] -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set system_message = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{{- bos_token -}}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}
    {%- endif -%}
    {%- if message['role'] == 'user' -%}
        {%- if loop.first and system_message -%}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' -}}
        {%- else -%}
            {{- '[INST] ' + message['content'] + ' [/INST]' -}}
        {%- endif -%}
    {%- elif message['role'] == 'assistant' -%}
        {{- message['content'] + eos_token -}}
    {%- else -%}
        {{- raise_exception('Only system, user and assistant roles are supported') -}}
    {%- endif -%}
{%- endfor -%}
"""

# fmt: off
_WORDS: tuple[str, ...] = (
    "the", "a", "an", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as",
    "you", "do", "at", "this", "but", "by", "from", "they", "we", "say", "she", "or", "will",
    "my", "one", "all", "would", "there", "their", "what", "so", "up", "out", "if", "about",
    "who", "get", "which", "go", "me", "when", "make", "can", "like", "time", "no", "just",
    "him", "know", "take", "people", "into", "year", "your", "good", "some", "could", "them",
    "see", "other", "than", "then", "now", "look", "only", "come", "its", "over", "think",
    "also", "back", "after", "use", "two", "how", "our", "work", "first", "well", "way",
    "even", "new", "want", "because", "any", "these", "give", "day", "most", "us", "number",
    "many", "colour", "shape", "side", "letter", "word", "answer", "question", "mix", "ball",
    "red", "blue", "green", "yellow", "orange", "purple", "circle", "square", "triangle",
    "count", "total", "sum", "have", "has", "gives", "get", "help", "assistant", "friendly",
    "patient", "tutor", "brief", "sentence", "picture", "image", "describe", "small", "large",
)
# fmt: on
# Seen often enough in training that the template's tags get pieces of their own.
_TEMPLATE_STRINGS: tuple[str, ...] = ("[INST] Hello [/INST]",) * 20


def _corpus(rng: random.Random, n_sentences: int = 3000) -> list[str]:
    """Generic English-like sentences: lower-case words, capitals, digits, `,` and `.`."""
    lines = list(_TEMPLATE_STRINGS)
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        if rng.random() < 0.2:
            words[rng.randrange(len(words))] += ","
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + ".")
    return lines


def _closing_bracket_pieces(
    vocab: dict[str, int], merges: list[tuple[str, str]]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Pieces around `]` as large SentencePiece vocabularies have them: `]` alone, and
    merged with the punctuation after it (`].`, `],`), never with the tag before it.

    Then `[/INST]` ends in a `]` piece that can merge with the first character of a
    reply glued to it — the boundary case the prefix-render mask and the splice must
    handle. Learned pieces containing `]` are dropped (with the merges that make them),
    the two punctuation merges appended; ids stay dense, specials and bytes first.
    """
    ordered = sorted(vocab, key=vocab.__getitem__)
    kept = [t for t in ordered if "]" not in t]
    kept += ["]", "].", "],"]
    merges = [(a, b) for a, b in merges if "]" not in a + b] + [("]", "."), ("]", ",")]
    return {t: i for i, t in enumerate(kept)}, merges


def sentencepiece_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE) -> LlamaTokenizerFast:
    """A Llama-2-layout tokenizer (Metaspace `▁` pieces, byte fallback) trained locally.

    transformers 5 rebuilds a `LlamaTokenizerFast` from vocab + merges on load (its own
    Metaspace pre-tokenizer, byte-fallback BPE and decoder), so only the vocabulary and the
    merges are taken from training; the pre-tokenizer used for training splits on `▁`
    like SentencePiece, so no learned piece spans two words.
    """
    backend = Tokenizer(BPE(unk_token=UNK, byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="always", split=True
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[UNK, BOS, EOS, *BYTE_PIECES],  # ids 0, 1, 2, then <0x00>.. at 3..258
    )
    backend.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    vocab, merges = _closing_bracket_pieces(
        dict(model["vocab"]), [tuple(m) for m in model["merges"]]
    )
    if [vocab[t] for t in (UNK, BOS, EOS, BYTE_PIECES[0], BYTE_PIECES[-1])] != [0, 1, 2, 3, 258]:
        raise RuntimeError("the trained vocabulary does not have Llama-2's layout")
    tokenizer = LlamaTokenizerFast(
        vocab=vocab,
        merges=merges,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        model_max_length=2048,
    )
    tokenizer.chat_template = INST_CHAT_TEMPLATE
    return tokenizer


def build_sentencepiece_target(
    out_dir: Path, *, seed: int = 0, num_layers: int = 4, vocab_size: int = VOCAB_SIZE
) -> Path:
    """Write the tiny random Llama + its SentencePiece-style tokenizer to out_dir (a few
    seconds, same bytes for the same seed) and return out_dir.

    Embedding rows past the tokenizer (vocab padding) are zeroed, as in the demo targets:
    greedy decoding then never emits ids the tokenizer cannot decode. `</s>` ends
    generation, as in the real checkpoints' generation config.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = sentencepiece_tokenizer(seed, vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (UNK, BOS, EOS)}
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=None,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = random_model(LlamaForCausalLM, config, len(tokenizer), seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], do_sample=False
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_sentencepiece_model_target(out_dir: Path, seed: int = 0) -> Path:
    """A target directory whose tokenizer is only a SentencePiece `tokenizer.model` (BPE,
    byte fallback, Llama-2's ids for `<unk>`, `<s>`, `</s>`) trained by `sentencepiece`
    itself, a `tokenizer_config.json`, the `[INST]` chat template and a Llama config: no
    `tokenizer.json`, so loading it runs transformers' SentencePiece conversion."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(random.Random(seed), n_sentences=1000)),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "legacy": False}
    config |= {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (out_dir / "chat_template.jinja").write_text(INST_CHAT_TEMPLATE)
    LlamaConfig(vocab_size=400, hidden_size=64, num_hidden_layers=1).save_pretrained(out_dir)
    return out_dir
