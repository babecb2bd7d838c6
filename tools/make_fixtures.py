#!/usr/bin/env python3
"""Writes the reference fixtures that tests/parity replays: tiny Hugging Face Llama models
with their logits, loss and gradients, tokenizer files with the ids tiktoken,
SentencePiece and Hugging Face `tokenizers` give for a corpus of awkward strings, and the
ids transformers' apply_chat_template gives for conversations in the Llama 3 and Llama 2
chat formats.

The fixtures are committed (tests/fixtures/); CI never runs this script. Regenerate them
after changing it, from the repository root, in a virtual environment outside it:

    python3 -m venv ../fixture-venv
    ../fixture-venv/bin/pip install -r tools/fixtures-requirements.txt
    ../fixture-venv/bin/python tools/make_fixtures.py

It needs these PyPI packages, at the versions pinned in tools/fixtures-requirements.txt:
torch 2.15.0 (the CPU build is enough), transformers 5.23.0, tiktoken 0.14.0 (and its
dependency regex, which splits the BPE training text), sentencepiece 0.2.3,
tokenizers 0.23.3, safetensors 0.8.0, numpy 2.4.6, jinja2 3.1.6, protobuf 7.36.2 (for
transformers to read a SentencePiece model). `--only tokenizer_json` (the tokenizer.json
fixtures) needs only tokenizers and numpy; `--only chat` transformers, tokenizers,
sentencepiece, protobuf and jinja2, not torch; `--only float8` only numpy and ml_dtypes. Every random number comes from a fixed seed and PyTorch
runs on one thread, so running it twice gives the same bytes. docs/parity.md describes
the files and the tests that replay them.
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import math
import random
import re
import shutil
import sys
from pathlib import Path

import numpy

# The model and tokenizer fixtures need these; `--only float8` needs only numpy and ml_dtypes,
# `--only tokenizer_json` only tokenizers.
try:
    import safetensors
    import safetensors.torch
    import sentencepiece
    import tiktoken
    import tiktoken._educational
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as missing:  # reported by main() unless only the float8 fixtures are made
    MISSING = missing
else:
    MISSING = None

IGNORE = -100
BATCH, SEQ_LEN = 2, 16

# ---------------------------------------------------------------------------------------
# Models

# Tiny shapes; intermediate_size is deliberately not what Meta's rounding rule would give
# for the hidden size, so the reader must take it from config.json.
#   config_style "classic": rope_theta and rope_scaling at the top level and torch_dtype,
#                           as the published Llama checkpoints' config.json has them;
#   config_style "v5":      what transformers 5 writes (rope_parameters holding
#                           rope_theta and the scaling; dtype).
VARIANTS = {
    # Llama 2: multi-head attention, theta 1e4, no scaling; saved in shards with an index.
    "llama2": dict(hidden=48, heads=4, kv_heads=4, ffn=88, vocab=160, layers=2, theta=10000.0,
                   eps=1e-6, scaling=None, tie=False, max_shard_bytes=100_000, config_style="classic",
                   seed=1002),
    # Llama 3: grouped-query attention (2 query heads per kv head), theta 5e5.
    "llama3": dict(hidden=48, heads=4, kv_heads=2, ffn=100, vocab=200, layers=2, theta=500000.0,
                   eps=1e-5, scaling=None, tie=False, max_shard_bytes=None, config_style="v5",
                   seed=1003),
    # Llama 3.1: one kv head for four query heads, rope_scaling "llama3" with a small
    # original context so that every branch of the frequency rescaling is taken.
    "llama3_1": dict(hidden=48, heads=4, kv_heads=1, ffn=88, vocab=160, layers=2, theta=500000.0,
                     eps=1e-5, scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=64),
                     tie=False, max_shard_bytes=None, config_style="classic", seed=1031),
    # Llama 3.2: tied embeddings (no lm_head tensor in the file), scaling factor 32.
    "llama3_2_tied": dict(hidden=32, heads=4, kv_heads=2, ffn=72, vocab=128, layers=2, theta=500000.0,
                          eps=1e-5, scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=256),
                          tie=True, max_shard_bytes=None, config_style="v5", seed=1032),
}
BF16_SOURCE = "llama3"  # its weights, rounded to bfloat16, become hf/llama3_bf16


def versions() -> dict[str, str]:
    return {
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
    }


def check_pinned_versions() -> None:
    """Warns when an installed package is not the version tools/fixtures-requirements.txt
    pins: the fixtures would still be valid, but their bytes may change."""
    from importlib.metadata import version
    pins = Path(__file__).resolve().parent / "fixtures-requirements.txt"
    for line in pins.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" not in line:
            continue
        package, pinned = line.split("==")
        installed = version(package).split("+")[0]
        if installed != pinned:
            print(f"warning: {package} {installed} is installed, {pinned} is pinned", file=sys.stderr)


def make_config(v: dict) -> LlamaConfig:
    rope = {"rope_type": "default", "rope_theta": v["theta"]}
    if v["scaling"]:
        rope = {"rope_type": "llama3", "rope_theta": v["theta"], **v["scaling"]}
    return LlamaConfig(
        vocab_size=v["vocab"], hidden_size=v["hidden"], intermediate_size=v["ffn"],
        num_hidden_layers=v["layers"], num_attention_heads=v["heads"], num_key_value_heads=v["kv_heads"],
        head_dim=v["hidden"] // v["heads"], max_position_embeddings=512, rms_norm_eps=v["eps"],
        rope_parameters=rope, tie_word_embeddings=v["tie"], attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, attn_implementation="eager",
        dtype=torch.float32)


def check_rope_scaling(name: str, v: dict) -> None:
    """Asserts that the llama3 rescaling keeps some frequencies, blends some and divides
    the rest by factor: otherwise the fixture would not test all three branches."""
    s = v["scaling"]
    head_dim = v["hidden"] // v["heads"]
    old = s["original_max_position_embeddings"]
    high_cutoff, low_cutoff = old / s["high_freq_factor"], old / s["low_freq_factor"]
    kinds = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * v["theta"] ** (2 * i / head_dim)
        kinds.append("kept" if wavelength < high_cutoff else "scaled" if wavelength > low_cutoff else "blended")
    print(f"  {name}: rope wavelengths vs cutoffs ({high_cutoff:g}, {low_cutoff:g}): {kinds}")
    assert {"kept", "blended", "scaled"} <= set(kinds), f"{name}: rope scaling does not take every branch"


def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Matrices ~ N(0, 0.08); norm weights ~ U(0.5, 1.5) so that they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def make_batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, T) and labels (B, T) = input_ids with a few positions ignored."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=g)
    labels = input_ids.clone()
    labels[0, 5] = IGNORE
    labels[0, SEQ_LEN - 1] = IGNORE  # never a target (the last position predicts nothing)
    labels[1, 9:12] = IGNORE
    return input_ids, labels


def write_reference(model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor, path: Path,
                    variant: str) -> float:
    """Runs forward with labels and backward of the mean loss; writes what tests/parity compares."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    logits = out.logits.detach().float()
    # The targets HF's loss used: labels shifted left by one, -100 at the last position.
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    check = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                              ignore_index=IGNORE)
    assert torch.allclose(check, out.loss.detach(), rtol=1e-6, atol=0), (check, out.loss)
    tensors = {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "targets": targets.to(torch.int64).contiguous(),
        "logits": logits.contiguous(),
        "loss": out.loss.detach().float().reshape(()),
    }
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{variant}: no gradient for {name}"
        tensors["grad." + name] = p.grad.detach().float().contiguous()
    # One metadata entry: safetensors writes several in no fixed order, and the bytes must
    # not change from one run to the next.
    about = {"variant": variant, "loss": "mean over targets != -100", "versions": versions()}
    safetensors.torch.save_file(tensors, str(path), metadata={"reference": json.dumps(about, sort_keys=True)})
    return float(out.loss.detach())


def to_classic_config(directory: Path, dtype_name: str) -> None:
    """Rewrites config.json the way the published Llama checkpoints spell it: rope_theta and
    rope_scaling at the top level (null when there is no scaling) and torch_dtype."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = dtype_name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_model(model: LlamaForCausalLM, directory: Path, v: dict, dtype_name: str) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    if v["max_shard_bytes"]:
        model.save_pretrained(directory, max_shard_size=v["max_shard_bytes"])
    else:
        model.save_pretrained(directory)
    if v["config_style"] == "classic":
        to_classic_config(directory, dtype_name)


def reload_and_compare(directory: Path, model: LlamaForCausalLM, input_ids: torch.Tensor) -> None:
    """The directory, read back by transformers, is the model the reference was made from."""
    again = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        a = again(input_ids=input_ids).logits
        b = model(input_ids=input_ids).logits
    assert torch.equal(a, b), f"{directory.name}: reloaded model gives other logits"
    assert torch.equal(again.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


def make_models(out: Path) -> None:
    hf = out / "hf"
    for name, v in VARIANTS.items():
        if v["scaling"]:
            check_rope_scaling(name, v)
        model = LlamaForCausalLM(make_config(v))
        init_weights(model, v["seed"])
        model.eval()
        directory = hf / name
        save_model(model, directory, v, "float32")
        input_ids, labels = make_batch(v["vocab"], v["seed"] + 1)
        reload_and_compare(directory, model, input_ids)
        loss = write_reference(model, input_ids, labels, directory / "reference.safetensors", name)
        files = sorted(p.name for p in directory.iterdir())
        print(f"  {name}: loss {loss:.6f}, files {files}")

        if name == BF16_SOURCE:
            # The same weights rounded to bfloat16, with a reference of their own computed in
            # float32 arithmetic from the rounded weights.
            bname = name + "_bf16"
            bdir = hf / bname
            save_model(copy.deepcopy(model).to(torch.bfloat16), bdir, dict(v, config_style="classic"), "bfloat16")
            rounded = LlamaForCausalLM.from_pretrained(bdir, dtype=torch.float32, attn_implementation="eager")
            for (n, a), (m, b) in zip(rounded.named_parameters(), model.named_parameters()):
                assert n == m and torch.equal(a, b.to(torch.bfloat16).float()), n
            rounded.eval()
            loss = write_reference(rounded, input_ids, labels, bdir / "reference.safetensors", bname)
            print(f"  {bname}: loss {loss:.6f}, files {sorted(p.name for p in bdir.iterdir())}")


# ---------------------------------------------------------------------------------------
# Tokenizers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TIKTOKEN_VOCAB = 640  # 256 single bytes and 384 merges
SP_VOCAB = 400


def llama3_special_tokens() -> list[str]:
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
    assert len(names) == 256 and len(set(names)) == 256
    return names


CORPUS = [
    "",
    "a",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    # accents, precomposed and combining
    "café naïve résumé façade",
    "cafe\u0301 nai\u0308ve",
    "Ångström and Øresund, Þórr, Straße",
    "e\u0301\u0301\u0301 stacked combining marks",
    # other scripts
    "日本語のテキストと漢字",
    "中文分词测试：你好，世界！",
    "한국어 문장입니다",
    "Привет, мир! Ёлка",
    "Γειά σου Κόσμε",
    "שלום עולם",
    "مرحبا بالعالم 123",
    "mixed עברית and English in one line",
    "हिन्दी पाठ",
    "ไทยภาษา",
    # emoji, with skin tones, ZWJ sequences and flags
    "😀😃😄",
    "👍🏽 thumbs up",
    "👨\u200d👩\u200d👧\u200d👦 family",
    "🏳\ufe0f\u200d🌈 flag, 🇫🇷🇯🇵 flags",
    "❤\ufe0f and ✔ and ☃",
    # whitespace
    " ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    "\r\n",
    "line one\r\nline two\r\n",
    "trailing spaces   ",
    "   leading spaces",
    "a  b   c    d     e",
    "tab\tseparated\t\tvalues",
    "mixed \t \n whitespace \n\t ",
    "word\n\n  indented after blank line",
    "\u00a0non-breaking\u00a0space and\u3000ideographic space",
    # digits
    "1234567",
    "3.14159",
    "1,000,000",
    "0",
    "12 345 6789 01234 567890",
    "v2.0.1-rc3",
    "٣٤٥ Arabic-Indic digits",
    "2024-01-15T08:30:00Z",
    # contractions
    "don't",
    "I'LL",
    "we've",
    "'s",
    "They'RE sure he'd've said I'm fine",
    "DON'T WON'T CAN'T",
    "it's Bob's",
    "rock 'n' roll",
    # punctuation
    "!!!???...",
    "Wait... what?!",
    "--- *** ___ ===",
    "(parentheses) [brackets] {braces} <angles>",
    "“curly quotes” and ‘single’ — dashes – and … ellipsis",
    "@user #hashtag $100 50% a&b ~tilde `backtick` ^caret |pipe \\backslash",
    # code
    "def f(x):\n    return x ** 2\n",
    "int main() { return 0; }",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "<html><body class=\"x\">Hi</body></html>",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "https://example.com/path?q=1&r=two#frag",
    # special-token text
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|begin_of_text|>Hello<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
    "<|reserved_special_token_247|> and <|reserved_special_token_248|>",
    "<|not_a_token|> <|eot_id",
    "<s>",
    "</s>",
    "<s>[INST] question [/INST] answer </s>",
    # longer paragraphs
    "The river ran high that spring. Nobody in the village could remember a year like it: "
    "the bridge was closed for three weeks, the bakery moved its ovens to the church hall, "
    "and the children, who should have been in school, spent their days counting the logs "
    "that floated past (347 by the last count, though some were surely counted twice).",
    "Residual connections let gradients flow through deep stacks of layers; normalisation "
    "keeps activations in a sensible range; rotary embeddings encode position by rotating "
    "pairs of features. Put together, they make a model that trains reliably at scale.\n\n"
    "In the second paragraph we repeat some words: layers, layers, layers; scale, scale.",
    "Ce texte est écrit en français, avec des accents : « élève », « où », « naïf ». "
    "Der Text enthält auch Deutsch: Größe, Übung, Äpfel. Y un poco de español: ¿Qué tal? ¡Bien!",
    "Line 1\nLine 2\n\nLine 4 after a blank\n    indented 4\n\tindented tab\nend",
]


GENERIC_TEXT = """\
Every morning the market opened at seven. The first stalls sold bread and cheese, the
next ones fruit and vegetables, and at the far end of the square an old man repaired
watches and radios. People came early to find the best tomatoes; they stayed late to
talk. On Saturdays there were more stalls, more people and more noise, and the cafe on
the corner put out twice as many tables.

The train left the station at 10:45 and arrived three hours later. It was not a fast
train, but it was a comfortable one, and the view from the window was worth the time:
fields, then forests, then a long lake with small boats on it. Some passengers read,
some slept, and some simply watched the country go by.

To make the soup, cut two onions and three carrots into small pieces. Warm the oil in a
large pot, add the vegetables and cook them slowly for ten minutes. Then add one litre of
water, a little salt and a bay leaf, and let it simmer for half an hour. Serve it hot,
with bread. It keeps for two or three days in a cold place.

The library had been built in 1887 with money from a local merchant. Its reading room was
tall and bright, with windows on three sides, and its shelves held more than 40,000 books.
Students worked there in the evenings; older readers came in the afternoons for the
newspapers. The building was restored in 1993 and again in 2015.

We measured the temperature every hour for a week. The lowest value was 3.5 degrees, the
highest 21.25 degrees, and the average was close to 12 degrees. The readings were written
in a notebook and later typed into a table, which we checked twice for errors.

def train(model, data, steps):
    for step in range(steps):
        loss = model.forward_backward(data.next())
        if step % 10 == 0:
            print(f"step {step}: loss {loss:.4f}")
    return model
"""

WORDS = ("the of and to in is was for on that with as it by at from this be are have were which not "
         "time people year day way thing man world life hand part child eye woman place work week "
         "case point number group problem fact water house city river market train window book "
         "small large long little great old new good high early young important few public "
         "said made found came went took gave saw knew thought looked wanted used called "
         "model layer weight token data loss step value table text word line page").split()


def generated_text(seed: int, sentences: int) -> str:
    """Deterministic English-like sentences (a random walk over WORDS)."""
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        n = rng.randint(5, 14)
        words = [rng.choice(WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randint(1, n - 1), str(rng.randint(0, 99999)))
        end = rng.choice([".", ".", ".", "?", "!", ";"])
        out.append(" ".join(words) + end)
        if i % 6 == 5:
            out.append("\n")
    return " ".join(out).replace(" \n ", "\n")


def training_text() -> str:
    return GENERIC_TEXT + "\n" + generated_text(7, 600) + "\n" + "\n".join(CORPUS) + "\n"


def make_tiktoken(out: Path, text: str) -> None:
    ranks = tiktoken._educational.bpe_train(text, TIKTOKEN_VOCAB, LLAMA3_PATTERN, visualise=None)
    assert len(ranks) == TIKTOKEN_VOCAB and all(bytes([b]) in ranks for b in range(256))
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "bpe.tiktoken").write_text("".join(lines))

    specials = {name: len(ranks) + i for i, name in enumerate(llama3_special_tokens())}
    enc = tiktoken.Encoding(name="tessera_fixture", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    entries = []
    for s in CORPUS:
        ordinary = enc.encode(s, disallowed_special=())
        special = enc.encode(s, allowed_special="all")
        assert enc.decode(ordinary) == s
        entries.append({"ordinary": ordinary, "allow_special": special})
    doc = {"num_base_tokens": len(ranks), "num_special_tokens": len(specials),
           "pattern": LLAMA3_PATTERN, "tiktoken": tiktoken.__version__, "encodings": entries}
    write_json(out / "tiktoken_ids.json", doc)
    n_merged = sum(len(e["ordinary"]) < len(s.encode()) for e, s in zip(entries, CORPUS) if s)
    print(f"  tiktoken: {len(ranks)} ranks + {len(specials)} special; merges shorten {n_merged} corpus strings")


def make_sentencepiece(out: Path, text: str) -> None:
    lines = [line for line in text.split("\n") if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=SP_VOCAB, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=0.995, max_sentencepiece_length=16,
        input_sentence_size=0, num_threads=1, minloglevel=2)
    data = model.getvalue()
    (out / "sp.model").write_bytes(data)
    sp = sentencepiece.SentencePieceProcessor(model_proto=data)
    assert sp.get_piece_size() == SP_VOCAB
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    ids = []
    for s in CORPUS:
        e = sp.encode_as_ids(s)
        assert sp.decode_ids(e) == s, (s, sp.decode_ids(e))
        ids.append(e)
    doc = {"vocab_size": SP_VOCAB, "sentencepiece": sentencepiece.__version__, "ids": ids}
    write_json(out / "sentencepiece_ids.json", doc)
    n_bytes = sum(any(3 <= i < 259 for i in e) for e in ids)
    print(f"  sentencepiece: {SP_VOCAB} pieces; {n_bytes} corpus strings use byte fallback")


def write_json(path: Path, doc) -> None:
    """Compact JSON, one corpus entry per line, UTF-8."""
    if isinstance(doc, list):
        text = "[\n" + ",\n".join(json.dumps(x, ensure_ascii=False) for x in doc) + "\n]\n"
    else:
        items = []
        for k, v in doc.items():
            if isinstance(v, list):
                body = "[\n" + ",\n".join("    " + json.dumps(x, ensure_ascii=False, separators=(",", ":")) for x in v) + "\n  ]"
            else:
                body = json.dumps(v, ensure_ascii=False)
            items.append(f"  {json.dumps(k)}: {body}")
        text = "{\n" + ",\n".join(items) + "\n}\n"
    assert json.loads(text) == doc
    path.write_text(text, encoding="utf-8")


def make_tokenizers(out: Path) -> None:
    tok = out / "tokenizers"
    tok.mkdir(parents=True, exist_ok=True)
    assert 40 <= len(CORPUS) <= 100 and len(set(CORPUS)) == len(CORPUS)
    write_json(tok / "corpus.json", CORPUS)
    text = training_text()
    make_tiktoken(tok, text)
    make_sentencepiece(tok, text)


# ---------------------------------------------------------------------------------------
# Hugging Face tokenizer.json (byte-level BPE): needs only the `tokenizers` package

# Strings besides CORPUS for the tokenizer.json fixtures: the added tokens inside text,
# and long inputs (one piece of thousands of bytes takes the heap merge).
HF_EXTRA_CORPUS = [
    "tessera",
    "use tessera to train",
    "a hello world inside",
    "x<custom>y<custom><custom>",
    "<s>tessera</s> and <|eot_id|>tessera<|begin_of_text|>",
    "tesseratessera tessera",
    "thequickbrownfoxjumpsoverthelazydog" * 20,
    " " * 600 + "x",
    "\n" * 100 + "end",
    "layers " * 100,
    "1234567890" * 30,
    "😀" * 40,
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the
    others for U+0100 on, in byte order (what `tokenizers` and transformers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiktoken_vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """transformers' TikTokenConverter.extract_vocab_merges_from_model: every split of a
    token into two tokens is a merge, ordered by the token's rank, then by the ranks of
    its halves."""
    enc = bytes_to_unicode()

    def as_str(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[as_str(token)] = rank
        if len(token) == 1:
            continue
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(local, key=lambda x: (ranks[x[0]], ranks[x[1]])))
    merges.sort(key=lambda m: m[2])
    return vocab, [(as_str(a), as_str(b)) for a, b, _ in merges]


def read_tiktoken(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_tokenizer_json(tokenizer, path: Path) -> None:
    """The tokenizer's JSON, one value a line (`tokenizers` orders the vocabulary by id)."""
    doc = json.loads(tokenizer.to_str())
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def make_tokenizer_json(out: Path) -> None:
    """tests/fixtures/tokenizers/hf_*/tokenizer.json and the ids `tokenizers` gives for
    corpus.json + hf_corpus.json in hf_ids.json ("ordinary": special-token text read as
    text; "allow_special" only where it differs; "decoded" only where decode differs):
      hf_llama3   bpe.tiktoken converted as transformers converts Llama 3's tiktoken file
                  (Split + ByteLevel, ignore_merges, 256 special added tokens, BOS template)
      hf_trained  BpeTrainer on the training text: ignore_merges false, the specials in the
                  vocabulary, non-special added tokens (one of them normalized)
      hf_gpt2     a smaller BpeTrainer vocabulary behind GPT-2's ByteLevel(use_regex) pre-
                  tokenizer, <s>/</s> with the eos in tokenizer_config.json's object form"""
    import tokenizers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = out / "tokenizers"
    tok.mkdir(parents=True, exist_ok=True)
    byte_alphabet = sorted(bytes_to_unicode().values())

    def template(bos: str, bos_id: int):
        return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                             special_tokens=[(bos, bos_id)])

    made = {}

    # Llama 3 style, from the tiktoken fixture.
    ranks = read_tiktoken(tok / "bpe.tiktoken")
    vocab, merges = tiktoken_vocab_merges(ranks)
    llama3 = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    llama3.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    llama3.decoder = decoders.ByteLevel()
    specials = llama3_special_tokens()
    llama3.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    llama3.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                                 template(specials[0], len(ranks))])
    made["hf_llama3"] = (llama3, {"bos_token": specials[0], "eos_token": specials[1]})

    text = training_text()
    lines = [line for line in text.split("\n") if line]

    # Trained with BpeTrainer, the specials first in the vocabulary.
    trained = Tokenizer(models.BPE(fuse_unk=False, ignore_merges=False))
    trained.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trained.decoder = decoders.ByteLevel()
    trained.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=520, show_progress=False, initial_alphabet=byte_alphabet,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]))
    trained.add_tokens([AddedToken("tessera", normalized=False), AddedToken(" hello world", normalized=False),
                        AddedToken("<custom>", normalized=True)])
    trained.post_processor = template("<|begin_of_text|>", trained.token_to_id("<|begin_of_text|>"))
    made["hf_trained"] = (trained, None)

    # GPT-2's pre-tokenizer, a smaller vocabulary.
    gpt2 = Tokenizer(models.BPE(fuse_unk=False))
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=330, show_progress=False, initial_alphabet=byte_alphabet, special_tokens=["<s>", "</s>"]))
    gpt2.add_tokens([AddedToken("tessera", normalized=False)])
    gpt2.post_processor = template("<s>", gpt2.token_to_id("<s>"))
    made["hf_gpt2"] = (gpt2, {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False,
                                                               "normalized": False, "rstrip": False,
                                                               "single_word": False, "special": True}})

    strings = CORPUS + HF_EXTRA_CORPUS
    write_json(tok / "hf_corpus.json", HF_EXTRA_CORPUS)
    doc = {"tokenizers": tokenizers.__version__}
    for name, (tokenizer, config) in made.items():
        directory = tok / name
        directory.mkdir(exist_ok=True)
        write_tokenizer_json(tokenizer, directory / "tokenizer.json")
        if config is not None:
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        reloaded = Tokenizer.from_file(str(directory / "tokenizer.json"))
        entries = []
        for s in strings:
            reloaded.encode_special_tokens = True
            ordinary = reloaded.encode(s, add_special_tokens=False).ids
            reloaded.encode_special_tokens = False
            special = reloaded.encode(s, add_special_tokens=False).ids
            entry = {"ordinary": ordinary}
            if special != ordinary:
                entry["allow_special"] = special
            decoded = reloaded.decode(ordinary, skip_special_tokens=True)
            if decoded != s:
                entry["decoded"] = decoded
            entries.append(entry)
        with_bos = reloaded.encode("a", add_special_tokens=True).ids
        doc[name] = {"vocab_size": reloaded.get_vocab_size(with_added_tokens=True), "bos": with_bos[0],
                     "encodings": entries}
    # Each named entry's list on its own lines: write_json handles one level, so flatten.
    text_out = "{\n" + f'  "tokenizers": {json.dumps(doc["tokenizers"])}'
    for name in made:
        d = doc[name]
        body = ",\n".join("      " + json.dumps(e, ensure_ascii=False, separators=(",", ":")) for e in d["encodings"])
        text_out += (f',\n  {json.dumps(name)}: {{"vocab_size": {d["vocab_size"]}, "bos": {d["bos"]}, '
                     f'"encodings": [\n{body}\n  ]}}')
    text_out += "\n}\n"
    assert json.loads(text_out) == doc
    (tok / "hf_ids.json").write_text(text_out, encoding="utf-8")

    # The Llama 3 conversion is transformers' own, when transformers is there to ask.
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        pass
    else:
        import tiktoken.load  # noqa: F401  (TikTokenConverter reads the file with it)
        assert TikTokenConverter(vocab_file=str(tok / "bpe.tiktoken")).extract_vocab_merges_from_model(
            str(tok / "bpe.tiktoken")) == (vocab, merges)
    sizes = ", ".join(f"{n} {t.get_vocab_size(with_added_tokens=True)}" for n, (t, _) in made.items())
    print(f"  tokenizer.json: {sizes} tokens; tokenizers {tokenizers.__version__}")


# ---------------------------------------------------------------------------------------
# Chat formats: transformers' apply_chat_template (needs transformers, tokenizers,
# sentencepiece, protobuf and jinja2; not torch)

REPO = Path(__file__).resolve().parent.parent

CHAT_CONVERSATIONS = [
    # One turn each way.
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    # A system message, white space to strip (ASCII, no-break space, ideographic space), two turns.
    [{"role": "system", "content": " You are terse. "},
     {"role": "user", "content": "  What is two plus three?\n"},
     {"role": "assistant", "content": "\u00a0Five.\u3000"},
     {"role": "user", "content": "And times?"},
     {"role": "assistant", "content": "Six.\n\n"}],
    # Unicode, newlines and template-like text inside the content.
    [{"role": "user", "content": "Übersetze: «héllo» — 你好 😀\nline two"},
     {"role": "assistant", "content": "[INST] is text here, as is <<SYS>>.\n  Indented line."}],
    # Numbers and punctuation runs; a longer reply.
    [{"role": "user", "content": "Count: 1234567, then 89!!!"},
     {"role": "assistant", "content": " ".join(["one two three four five six seven"] * 12)}],
    # Ends with a user turn (a prompt to answer).
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}],
]


def make_chat(out: Path) -> None:
    """tests/fixtures/chat/chat_ids.json: for each conversation and chat format, the ids
    transformers' apply_chat_template gives with that model's template, with and
    without the generation prompt where the template allows it. Llama 3 through the
    hf_llama3 tokenizer.json fixture; Llama 2 through the SentencePiece fixture sp.model
    loaded as a LlamaTokenizer with legacy true (Meta's reference encoding)."""
    import tempfile
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok_dir = out / "tokenizers"
    source = (REPO / "include" / "tessera" / "io" / "chat.hpp").read_text()
    templates = {name: cpp_string_constant(source, f"{name}_chat_template") for name in ("llama3", "llama2")}
    llama3 = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "hf_llama3" / "tokenizer.json"),
                                     bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    llama3.chat_template = templates["llama3"]
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(tok_dir / "sp.model", Path(d) / "tokenizer.model")
        (Path(d) / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "legacy": True, "add_bos_token": True, "add_eos_token": False, "chat_template": templates["llama2"]}))
        llama2 = AutoTokenizer.from_pretrained(d)
    cases = []
    for messages in CHAT_CONVERSATIONS:
        for fmt, tokenizer in (("llama3", llama3), ("llama2", llama2)):
            for generation in (False, True):
                if fmt == "llama2" and generation != (messages[-1]["role"] == "user"):
                    continue  # Llama 2's template has no generation prompt: a prompt ends with a user turn
                ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation,
                                                    return_dict=False)
                cases.append({"format": fmt, "generation_prompt": generation, "messages": messages, "ids": ids})
    chat = out / "chat"
    chat.mkdir(parents=True, exist_ok=True)
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases)
    (chat / "chat_ids.json").write_text("[\n" + body + "\n]\n", encoding="utf-8")
    print(f"  chat: {len(cases)} conversations in llama3 and llama2 formats")


def cpp_string_constant(source: str, name: str) -> str:
    """The value of `inline constexpr std::string_view NAME = "..." "...";` in C++ source:
    adjacent string literals joined, the escapes \\n \\\\ \\" \\' read."""
    start = source.index(f"{name} =") + len(name) + 2
    end = source.index(";", start)
    text = ""
    for literal in re.findall(r'"((?:[^"\\]|\\.)*)"', source[start:end]):
        text += re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"', "'": "'"}[m.group(1)], literal)
    return text


# ---------------------------------------------------------------------------------------
# Float8 conversions

FLOAT8_SAMPLE = 1 << 16  # random floats, besides the structured ones


def splitmix64(state: int) -> tuple[int, int]:
    """One step of SplitMix64: (new state, output). tests/core/test_float8.cpp runs the same."""
    state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return state, z ^ (z >> 31)


def float8_sample_bits() -> numpy.ndarray:
    """The float32 inputs the sample fixtures convert, as bits: FLOAT8_SAMPLE random ones
    (half any bits at all, half with an exponent in [2^-20, 2^17], around both formats'
    ranges), then for each format every midpoint between neighbouring magnitudes and the
    floats on either side of it, then the magnitudes themselves."""
    import ml_dtypes

    bits = []
    state = 0x5EED_F1_0A78
    for i in range(FLOAT8_SAMPLE):
        state, r = splitmix64(state)
        u = r >> 32
        if i % 2 == 1:
            exponent = 127 - 20 + (u >> 23) % 38  # 2^-20 .. 2^17
            u = (u & 0x807FFFFF) | (exponent << 23)
        bits.append(u)
    for dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        codes = numpy.arange(128, dtype=numpy.uint8).view(dtype).astype(numpy.float32)
        finite = numpy.sort(codes[numpy.isfinite(codes)])
        for a, b in zip(finite[:-1], finite[1:]):
            mid = numpy.float32((numpy.float64(a) + numpy.float64(b)) / 2)
            for v in (numpy.nextafter(mid, numpy.float32(-numpy.inf)), mid, numpy.nextafter(mid, numpy.float32(numpy.inf))):
                bits.append(int(numpy.float32(v).view(numpy.uint32)))
                bits.append(int(numpy.float32(-v).view(numpy.uint32)))
        for v in finite:
            bits.append(int(numpy.float32(v).view(numpy.uint32)))
    return numpy.array(bits, dtype=numpy.uint32)


def make_float8(out: Path) -> None:
    """tests/fixtures/float8/: ml_dtypes' saturating conversions (clamp to the largest
    finite value, then its cast: torchao's to_fp8_saturated) of every bf16 value and of
    the sample floats, one byte each, and each format's 256 codes as float32."""
    import ml_dtypes

    f8 = out / "float8"
    f8.mkdir(parents=True, exist_ok=True)
    every_bf16 = (numpy.arange(1 << 16, dtype=numpy.uint32) << 16).view(numpy.float32)
    sample = float8_sample_bits().view(numpy.float32)
    for name, dtype in (("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)):
        largest = numpy.float32(ml_dtypes.finfo(dtype).max)
        with numpy.errstate(invalid="ignore", over="ignore"):
            for label, values in (("bf16", every_bf16), ("sample", sample)):
                codes = numpy.clip(values, -largest, largest).astype(dtype).view(numpy.uint8)
                (f8 / f"{label}_to_{name}.bin").write_bytes(codes.tobytes())
        decoded = numpy.arange(256, dtype=numpy.uint8).view(dtype).astype(numpy.float32)
        (f8 / f"{name}_values.bin").write_bytes(decoded.astype("<f4").tobytes())
    print(f"  float8: {len(sample)} sample floats, ml_dtypes {ml_dtypes.__version__}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures",
                        help="fixture folder (default: tests/fixtures of this repository)")
    parser.add_argument("--only", choices=["float8", "tokenizer_json", "chat"],
                        help="make only these fixtures (float8: numpy and ml_dtypes; tokenizer_json: tokenizers; "
                             "chat: transformers without torch)")
    args = parser.parse_args()
    if args.only == "float8":
        make_float8(args.out)
        return 0
    if args.only == "tokenizer_json":
        make_tokenizer_json(args.out)
        return 0
    if args.only == "chat":
        make_chat(args.out)
        return 0
    if MISSING is not None:
        raise SystemExit(f"make_fixtures.py: {MISSING} (tools/fixtures-requirements.txt lists what it needs)")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    check_pinned_versions()
    print("library versions:", versions())
    print("models:")
    make_models(args.out)
    print("tokenizers:")
    make_tokenizers(args.out)
    make_tokenizer_json(args.out)
    print("chat:")
    make_chat(args.out)
    print("float8:")
    make_float8(args.out)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"fixtures: {total / 1e6:.2f} MB under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
