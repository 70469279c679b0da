"""Tokenization and chat templates without torch, for the router.

`transformers.AutoTokenizer` imports torch (seconds and hundreds of MB per router replica), so
the router uses the `tokenizers` library on the model's `tokenizer.json` and renders the chat
template with jinja2 the way `transformers` does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, a non-escaping `tojson`). Tests check both against `transformers`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from specserve.protocol import SpecserveError


def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class TextCodec:
    """encode / decode / chat prompt for one model directory (Hugging Face layout)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise SpecserveError(f"{model_dir} has no tokenizer.json (a fast tokenizer is required)")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = model_dir / "chat_template.jinja"
        self.chat_template = template_path.read_text() if template_path.exists() else self.config.get("chat_template")

    @classmethod
    def for_model(cls, ref: str, *, pull_missing: bool = True) -> TextCodec:
        """A registry name or local directory, or a Hub id (fetches only the tokenizer files)."""
        from specserve import models

        path = Path(models.resolve(ref, pull_missing=pull_missing))
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(ref), allow_patterns=["tokenizer*", "chat_template*",
                                                                    "special_tokens_map.json"]))
        return cls(path)

    def _special(self, name: str) -> str | None:
        token = self.config.get(name)
        return token.get("content") if isinstance(token, dict) else token

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @cached_property
    def _template(self):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise SpecserveError("this model has no chat template: use /v1/completions")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def chat_prompt(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        import jinja2

        specials = {name: self._special(name) for name in
                    ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **specials)
        except jinja2.TemplateError as exc:
            raise SpecserveError(f"the chat template refused these messages: {exc}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already writes any special tokens the model expects.
        return self.encode(self.chat_prompt(messages), add_special_tokens=False)


def check_same_vocabulary(target: TextCodec, draft: TextCodec) -> None:
    """Refuse a draft whose token -> id mapping or EOS token differs from the target's."""
    ours = target.tokenizer.get_vocab(with_added_tokens=True)
    theirs = draft.tokenizer.get_vocab(with_added_tokens=True)
    if ours != theirs:
        differing = sum(1 for tok, i in theirs.items() if ours.get(tok) != i) + len(ours.keys() - theirs.keys())
        raise SpecserveError(
            f"draft and target do not share a vocabulary ({len(theirs)} vs {len(ours)} tokens, "
            f"{differing} differ): a draft must use the target's tokenizer"
        )
    if target._special("eos_token") != draft._special("eos_token"):
        raise SpecserveError(
            f"draft and target have different EOS tokens ({draft._special('eos_token')!r} vs "
            f"{target._special('eos_token')!r})"
        )
