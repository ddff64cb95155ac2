"""Text <-> token ids and chat-template rendering for a local Hugging Face model folder or GGUF file.

Role: the engine's only tokenizer. It reads `tokenizer.json` with the `tokenizers` library and the
side files (`tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`,
`config.json`) directly, so the runtime never needs `transformers`. A GGUF file carries no
tokenizer.json: `engine/gguf/tokenizer.py` rebuilds the same `tokenizers.Tokenizer` from its metadata
(checked against transformers' GGUF loader by tests/gguf/).

Invariants (checked against transformers 5.x by tests/test_tokenizer.py):
- `encode(text)` equals `AutoTokenizer.from_pretrained(folder)(text)["input_ids"]`. As in
  transformers 5, the post-processor stored in `tokenizer.json` decides whether BOS/EOS are added;
  `add_bos_token` in `tokenizer_config.json` is only reported, because transformers 5 ignores it
  whenever a `tokenizer.json` exists.
- `apply_chat_template(..., tokenize=False)` renders byte-identically to transformers: same
  sandboxed Jinja environment options, globals, filters and template variables.
- `eos_token_ids` is the union of every EOS a model declares (generation config, model config,
  tokenizer), so generation stops on any of them.
- jinja2 is imported at the first chat-template render, never with this module (a server's start
  does not pay for it; tests/test_import_budget.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _BackendTokenizer

if TYPE_CHECKING:
    import jinja2

# Named special tokens that transformers exposes to chat templates as variables.
_SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are plain strings or serialised AddedToken dicts."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(item) for item in value if item is not None}


class _TemplateDict:
    # Templates may call dict(...), but must not reach the real type object (and through it, internals).
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _template_namespace() -> type:
    """Jinja's `namespace`, refusing dunder-ish names; built on first render (jinja2 is imported then)."""
    import jinja2.exceptions
    import jinja2.utils

    class _TemplateNamespace(jinja2.utils.Namespace):
        # Dunder names on a namespace would open a path to CPython internals from an untrusted template.
        def __init__(*args: Any, **kwargs: Any) -> None:
            # Same signature trick as jinja's Namespace, so that `namespace(self=...)` still works.
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}."
                )

    return _TemplateNamespace


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compiles once per template string; untrusted Hub templates only ever run in the sandbox.

    jinja2 is imported here, at the first render, not with the module: a server start that renders
    no chat template (and every GGUF/folder load) does not pay for it.
    """
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _template_namespace()
    return env.from_string(source)


def _load_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; a lone template is stored under "default". Separate files win, as in transformers."""
    templates: dict[str, str] = {}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = config.get("chat_template")
    if raw is None:
        raw = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {str(item["name"]): str(item["template"]) for item in raw}
    if isinstance(raw, Mapping):
        return {str(name): str(template) for name, template in raw.items()}
    return {}


class Tokenizer:
    """A byte-level (or any `tokenizers`) tokenizer plus the model's chat template and stop ids."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        config: Mapping[str, Any],
        chat_templates: Mapping[str, str],
        eos_token_ids: Iterable[int],
        name: str = "",
    ) -> None:
        self._backend = backend
        self.name = name
        self._chat_templates = dict(chat_templates)
        self.special_tokens: dict[str, str] = {}
        for attr in _SPECIAL_TOKEN_ATTRIBUTES:
            content = _token_content(config.get(attr))
            if content is not None:
                self.special_tokens[attr] = content
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        extra_tokens = [_token_content(t) for t in (extra.values() if isinstance(extra, Mapping) else extra)]
        self.extra_special_tokens: list[str] = [t for t in extra_tokens if t is not None]
        # transformers adds configured special tokens that tokenizer.json lacks; ids must agree with it.
        missing = [
            t for t in [*self.special_tokens.values(), *self.extra_special_tokens] if backend.token_to_id(t) is None
        ]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.add_bos_token: bool | None = config.get("add_bos_token")
        eos = set(eos_token_ids)
        eos_token = self.special_tokens.get("eos_token")
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos.add(backend.token_to_id(eos_token))
        self._eos_token_ids = frozenset(eos)
        special = [*self.special_tokens.values(), *self.extra_special_tokens]
        self._all_special_ids = sorted({i for t in special if (i := backend.token_to_id(t)) is not None})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face folder (tokenizer.json and side files) or a GGUF file's metadata."""
        from .gguf.detect import is_gguf_file

        if is_gguf_file(path):
            return cls.from_gguf(path)
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found in model folder {folder}: Tidepool needs a fast-tokenizer file "
                "(save one with transformers' tokenizer.save_pretrained)"
            )
        backend = _BackendTokenizer.from_file(str(tokenizer_file))
        # Decoding and the engine's own calls must never pad or truncate.
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        eos_ids = _as_id_set(_read_json(folder / "generation_config.json").get("eos_token_id")) | _as_id_set(
            _read_json(folder / "config.json").get("eos_token_id")
        )
        return cls(backend, config, _load_chat_templates(folder, config), eos_ids, name=str(folder))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file describes (`engine/gguf/tokenizer.py`); GGUFError when it has none."""
        from .gguf.reader import open_gguf
        from .gguf.tokenizer import GGUFTokenizerSpec

        spec = GGUFTokenizerSpec(open_gguf(path))
        return cls(spec.backend(), spec.config(), spec.chat_templates(), spec.stop_ids(), name=str(path))

    # -- ids -------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> _BackendTokenizer:
        """The underlying `tokenizers.Tokenizer` (the detokenizer decodes small windows with it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self._backend.token_to_id(bos)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._all_special_ids)

    # -- chat ------------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def get_chat_template(self, name: str | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """Picks a template the way transformers does: by name, else "tool_use" when tools are given."""
        if not self._chat_templates:
            raise ValueError(
                f"Model {self.name or '<unnamed>'} has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja); send a plain completion prompt instead"
            )
        if name is not None:
            if name in self._chat_templates:
                return self._chat_templates[name]
            raise ValueError(f"No chat template named {name!r}; available: {sorted(self._chat_templates)}")
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        raise ValueError(
            f"Model has several chat templates and none is named 'default'; pick one of {sorted(self._chat_templates)}"
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` to a prompt string, like transformers' `apply_chat_template(tokenize=False)`."""
        # Like transformers, `chat_template` is either a template's name or the template itself.
        is_source = chat_template is not None and chat_template not in self._chat_templates
        source = chat_template if is_source else self.get_chat_template(chat_template, tools)
        template = _compile_template(source)
        variables: dict[str, Any] = {**self.special_tokens, **kwargs}
        variables.setdefault("documents", None)
        return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
