#!/usr/bin/env python3
"""Checks tessera's Hugging Face tokenizer export against transformers itself.

For each fixture tokenizer (tiktoken, SentencePiece, tokenizer.json), the exporter
(tests/io/export_hf_tokenizer.cpp: train::write_hf_tokenizer, what save_hf_model writes
beside the weights, and a config.json) writes a directory with the ids tessera gives for
the fixture corpus. transformers' AutoTokenizer.from_pretrained must load that directory
with no warning and no fallback, as the backend its tokenizer_config.json names, and give
the same ids: special-token text as text (split_special_tokens) and as special tokens,
with the BOS prepended, and the same decoded text; its bos/eos tokens must be tessera's,
and its chat template, rendered by apply_chat_template, must give the ids tessera's chat
format (io/chat.hpp) gives for the conversations of tests/fixtures/chat/chat_ids.json. SentencePiece (Llama 2) is loaded as transformers'
SentencePieceBackend, which runs SentencePiece itself: its ids are exact, but
transformers decodes them piece by piece (byte-fallback pieces stay "<0xC3>", spaces are
stripped), so its decoded text is not compared; and tessera's SentencePiece tokenizer
reads "<s>" in text as text, as SentencePiece does, so its ids are compared with
split_special_tokens throughout.

    check_hf_export.py EXPORTER FIXTURES_DIR

It needs transformers (5.23.0), tokenizers, sentencepiece and jinja2; where `import
transformers` fails it exits 77 (skipped: CI's python3 has none). The Python is
$TESSERA_PYTHON when set, else the one running this script; the fixture venv of
tools/fixtures-requirements.txt has everything:

    TESSERA_PYTHON=/path/to/venv/bin/python meson test -C build hf_tokenizer_export
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

SKIP = 77

# (fixture path under tokenizers/, the class transformers must load)
CASES = [
    ("bpe.tiktoken", "TokenizersBackend"),
    ("sp.model", "SentencePieceBackend"),
    ("hf_llama3", "TokenizersBackend"),
    ("hf_trained/tokenizer.json", "TokenizersBackend"),
    ("hf_gpt2", "TokenizersBackend"),
]
SENTENCEPIECE = "SentencePieceBackend"


def main() -> int:
    python = os.environ.get("TESSERA_PYTHON")
    # A venv's python is a link to the system one: compare the paths, not what they point to.
    if python and os.path.abspath(python) != os.path.abspath(sys.executable) and "TESSERA_PYTHON_EXEC" not in os.environ:
        os.environ["TESSERA_PYTHON_EXEC"] = "1"
        os.execv(python, [python, *sys.argv])
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    exporter, fixtures = sys.argv[1], Path(sys.argv[2]) / "tokenizers"
    try:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers
        from transformers import AutoTokenizer
    except ImportError as e:
        print(f"skipped: {e} (set TESSERA_PYTHON to a Python with transformers)")
        return SKIP

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    failures = 0
    corpus = [str(fixtures / "corpus.json"), str(fixtures / "hf_corpus.json"),
              str(fixtures.parent / "chat" / "chat_ids.json")]
    with tempfile.TemporaryDirectory(prefix="tessera_hf_export_") as tmp:
        for case, backend in CASES:
            out = Path(tmp) / case.replace("/", "_")
            subprocess.run([exporter, str(fixtures / case), str(out), *corpus], check=True)
            ref = json.loads((out / "tessera_ids.json").read_text(encoding="utf-8"))
            log.seek(0)
            log.truncate()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tok = AutoTokenizer.from_pretrained(str(out))
            problems = [str(w.message) for w in caught] + [line for line in log.getvalue().splitlines() if line]
            if type(tok).__name__ != backend:
                problems.append(f"loaded as {type(tok).__name__}, not {backend}")
            if tok.bos_token_id != ref["bos_id"] or tok.eos_token_id != ref["eos_id"]:
                problems.append(f"bos/eos {tok.bos_token_id}/{tok.eos_token_id}, tessera {ref['bos_id']}/{ref['eos_id']}")
            for i, e in enumerate(ref["entries"]):
                s = e["text"]
                split = backend == SENTENCEPIECE
                got = {
                    "ordinary": tok.encode(s, add_special_tokens=False, split_special_tokens=True),
                    "allow_special": tok.encode(s, add_special_tokens=False, split_special_tokens=split),
                    "with_bos": tok.encode(s, split_special_tokens=split),
                }
                for key, ids in got.items():
                    if ids != e[key]:
                        problems.append(f"{key} ids of corpus[{i}] {s[:40]!r}: transformers {ids[:12]}, tessera {e[key][:12]}")
                decoded = tok.decode(e["ordinary"], skip_special_tokens=True)
                if backend != SENTENCEPIECE and decoded != e["decoded"]:
                    problems.append(f"decode of corpus[{i}] {s[:40]!r}: transformers {decoded[:40]!r}, tessera {e['decoded'][:40]!r}")
            if not ref["chats"]:
                problems.append("tessera gave no chat ids to compare")
            for i, c in enumerate(ref["chats"]):
                ids = tok.apply_chat_template(c["messages"], tokenize=True, add_generation_prompt=c["generation_prompt"],
                                              return_dict=False)
                if ids != c["ids"]:
                    problems.append(f"chat {i}: apply_chat_template {ids[:16]}..., tessera {c['ids'][:16]}...")
            status = "ok  " if not problems else "FAIL"
            print(f"{status} {case}: {type(tok).__name__}, {len(ref['entries'])} strings, {len(ref['chats'])} chats, "
                  f"transformers {transformers.__version__}")
            for p in problems[:20]:
                print(f"     {p}")
            failures += bool(problems)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
