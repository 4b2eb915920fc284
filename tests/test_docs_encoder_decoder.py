"""docs/encoder_decoder.md: every example runs, on a tiny random model of the checkpoint's family
saved (with a tokenizer and its feature extractor / image processor) where the checkpoint's name
stood -- the real checkpoints cannot be fetched here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import seq2seq_models as S

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parent.parent / "docs" / "encoder_decoder.md"
CHECKPOINTS = {"google-t5/t5-small": "t5", "google/pegasus-xsum": "pegasus", "openai/whisper-tiny": "whisper",
               "nlpconnect/vit-gpt2-image-captioning": "vision", "microsoft/git-base": "git"}


def _examples() -> list[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8").split("## Examples", 1)[1]
    out = []
    for part in re.split(r"^### ", text, flags=re.MULTILINE)[1:]:
        title = part.splitlines()[0].strip()
        out += [(title, code) for code in re.findall(r"```python\n(.*?)```", part, flags=re.DOTALL)]
    return out


def _save(name: str, folder: Path) -> None:
    import transformers

    names = {90: "<|en|>", 91: "<|transcribe|>"} if name == "whisper" else None
    S.save_with_tokenizer(S.build(name), str(folder), names)
    if name == "whisper":  # 8 mel bins, 32 frames a chunk: the tiny model's input
        transformers.WhisperFeatureExtractor(feature_size=8, sampling_rate=16000, hop_length=500, chunk_length=1,
                                             n_fft=400).save_pretrained(folder)


def test_every_example_names_a_known_checkpoint():
    examples = _examples()
    assert len(examples) == 5
    for title, code in examples:
        assert any(ckpt in code for ckpt in CHECKPOINTS), title


@pytest.mark.parametrize(("title", "code"), _examples(), ids=[t for t, _ in _examples()])
def test_doc_example_runs(title, code, tmp_path, capsys):
    for ckpt, name in CHECKPOINTS.items():
        if ckpt in code:
            _save(name, tmp_path / name)
            code = code.replace(f'"{ckpt}"', repr(str(tmp_path / name)))
    exec(compile(code, f"docs/encoder_decoder.md:{title}", "exec"), {"__name__": "__doc_example__"})  # noqa: S102
    printed = capsys.readouterr().out
    assert printed.strip(), title
