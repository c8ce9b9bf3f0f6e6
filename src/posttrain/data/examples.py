"""What every task source hands out: an `Example`, the prompt limits it carries, and the base of
the finite sources (`ListSource`: JSON-lines files here, hub datasets in data/hub.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from posttrain.errors import ConfigError


@dataclass  # not frozen: Lightning rebuilds dataclasses when moving batches to a device
class Example:
    prompt: str
    response: str          # the reference solution (SFT target)
    answer: str | None     # the final answer a verifier compares against
    # The prompt's token ids when they are not simply the tokenised `prompt`: set only for a
    # prompt cut to fit the model (data.truncate_prompts). Verifiers keep reading `prompt`.
    prompt_ids: list[int] | None = None
    # A chat prompt ([system], user, ...): rendered with the tokenizer's chat template where
    # token ids are made (datamodule.prompt_text); `prompt` then holds the question as text.
    messages: list[dict] | None = None
    # Which source or task it came from, for metrics per source (`rollout/<source>/accuracy`,
    # `eval/<source>/accuracy`) and routing: a mixture's source name, a reasoning-gym task's
    # name. None: one undivided source.
    source: str | None = None


def judging_source(source, example: Example):
    """The source that judges `example`: in a mixture (data=mixture) the one its `source` names
    (`source_of`), else `source` itself."""
    return source.source_of(example) if hasattr(source, "source_of") else source


@dataclass(frozen=True)
class PromptLimits:
    """How long prompts may be, from the `data` config (checked once the tokenizer exists)."""

    max_response_tokens: int = 0         # the generation budget that must fit after the prompt
    max_prompt_tokens: int | None = None  # an explicit cap below the model's context
    truncate: str | None = None           # None: an over-long prompt is an error; "left": keep its end


class ListSource:
    """A finite source: examples held per split, each with where it came from."""

    def __init__(self):
        self.examples: dict[str, list[Example]] = {}
        self.origins: dict[str, list[str]] = {}  # where each example was read, for later errors
        self.prompt_limits = PromptLimits()

    @functools.cached_property
    def alphabet(self) -> str:
        """Every character of the examples (the embedded tiny model's vocabulary)."""
        texts = (text for examples in self.examples.values() for e in examples
                 for text in (e.prompt, e.response, e.answer or "", *(m["content"] for m in e.messages or ())))
        return "".join(sorted(set().union(*map(set, texts))))

    def size(self, split: str) -> int | None:
        return len(self._split(split))

    def origin(self, split: str, index: int) -> str | None:
        """Where example ``index`` of ``split`` was read, e.g. ``file:line (data.files.<split>)``."""
        self._split(split)
        return self.origins[split][index]

    def missing_split(self, split: str) -> str:
        """Why ``split`` has no examples, and which key gives it some."""
        raise NotImplementedError

    def _split(self, split: str) -> list[Example]:
        if split not in self.examples:
            raise ConfigError(self.missing_split(split))
        return self.examples[split]

    def example(self, split: str, index: int) -> Example:
        return self._split(split)[index]
