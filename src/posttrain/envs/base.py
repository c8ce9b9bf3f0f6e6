"""The environment interface: what answers a policy's turn.

An `Environment` starts an `Episode` from a task example; the collector then alternates
turns (the policy samples until an end-of-turn token or its per-turn budget) and episode
steps (the episode reads the turn and replies with an observation, a reward and whether it
is done). Token in, token out: the collector keeps the ids the policy sampled and appends
the reply's tokens after them; a turn's `text` is for the episode to read, never re-encoded.

A reply's observation is chat messages (rendered with the tokenizer's chat template, as the
turn after an assistant message) or plain text (tokenised as it is, for prompts without a
chat template, like the embedded model's). Its `reward` counts for this turn: a trajectory's
score is the sum of its turns' rewards (the `environment` reward component), and algorithms
that give credit per token (`advantage=gae`, `advantage=prm_step`) see each at the end of
its turn.

Users add their own environment by `_target_` (docs/environments.md):

    env:
      _target_: mypackage.MyEnvironment
      max_turns: 4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from posttrain.data.examples import Example
from posttrain.errors import ConfigError


@dataclass
class Turn:
    """One policy turn, as the episode sees it."""

    text: str             # decoded, special tokens skipped: for reading only
    token_ids: list[int]  # the ids the policy sampled (its end-of-turn token included when it ended)
    ended: bool           # closed by an end-of-turn token; False: cut at the turn's token budget
    index: int            # 0 for the first turn


@dataclass
class Reply:
    """The environment's answer to a turn. At most one of `messages` and `text` is set; neither
    on the last turn of an episode (nothing follows it)."""

    reward: float = 0.0                     # this turn's reward
    done: bool = False                      # the episode is over
    messages: list[dict] | None = None      # chat messages (role "user" or "tool") the policy reads next
    text: str | None = None                 # or plain text, appended as it is
    correct: bool | None = None             # the episode's verdict (held-out accuracy), when it has one
    metrics: dict[str, float] = field(default_factory=dict)  # counts to add up: tool_calls, tool_errors, ...


class Episode(Protocol):
    def step(self, turn: Turn) -> Reply: ...


class Environment:
    """The base every environment extends.

    `max_turns` bounds an episode's policy turns. (The embedded model's tokenizer knows the
    characters of its task source only: an environment for it replies in those; a character
    it lacks is an error naming it.) Subclasses implement `start`, and may override `prepare` (the
    prompt an episode starts from: a system prompt describing tools, say), `check` (a start-up
    check of what the environment needs, like the sandbox's isolation), `attach` and
    `worked_episode` (a demonstration for SFT)."""

    name = "environment"
    # the counts its replies report (Reply.metrics): held-out evaluation reduces these over the ranks
    metric_names: tuple[str, ...] = ()

    def __init__(self, max_turns: int = 1):
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ConfigError(f"env.max_turns must be an integer >= 1, got {max_turns!r}")
        self.max_turns = max_turns

    def prepare(self, example: Example) -> Example:
        """The example an episode starts from (its prompt is what the policy reads first)."""
        return example

    def start(self, example: Example) -> Episode:
        raise NotImplementedError(f"{type(self).__name__} must implement start(example) -> Episode")

    def check(self) -> None:
        """Raise a ConfigError when this machine cannot run the environment as configured."""

    def worked_episode(self, example: Example) -> list[dict] | None:
        """A worked episode of `example` as chat messages after its prompt: the policy's turns
        ("assistant") and the environment's replies ("tool", "user"), ending with a policy turn.
        SFT with this environment (`algorithm=sft env=...`, `algorithm.warm_start.with_env`)
        trains on the policy's turns, the replies masked out (envs/worked.py). None: it has
        none, and the SFT target is the example's reference response."""
        return None

    def attach(self, source) -> None:
        """Called once with the run's task source. An environment that is the only judge of the
        source's answers (env=code: tests run in the sandbox) hands it its verifier here, so an
        episode cut before the environment gave a verdict is still judged."""


# --- observations as tokens ------------------------------------------------------------------

def observation_ids(reply: Reply, tokenizer) -> list[int]:
    """The token ids that follow a policy turn for `reply`: its chat messages rendered as the
    turn after an assistant message (with the next assistant turn opened), or its text."""
    if reply.messages is not None and reply.text is not None:
        raise ValueError("a Reply gives messages or text, not both")
    if reply.messages is not None:
        text = chat_continuation(reply.messages, tokenizer)
    elif reply.text is not None:
        text = reply.text
    else:
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in ids:
        raise ConfigError(f"an environment's reply {text!r:.80} has a character the tokenizer does not know "
                          f"(the embedded model's vocabulary is its task's characters): reply in those, or give the "
                          f"task source an alphabet that holds them")
    return ids


_PROBE = "\x00posttrain-probe\x00"  # an assistant message no real chat contains


def chat_continuation(messages: list[dict], tokenizer) -> str:
    """What the chat template writes after an assistant message that ended with its end-of-turn
    token: `messages`, then the next assistant turn opened. Found by rendering a probe chat with
    and without them, so it holds for any template that renders a chat as a prefix of a longer
    one (ChatML, Llama 3, SmolLM2, Qwen)."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the environment replies with chat messages, but the tokenizer of "
                          f"{getattr(tokenizer, 'name_or_path', None) or 'this model'!r} has no chat template; "
                          f"give the replies as text (Reply.text) or use a model with a chat template")
    before = tokenizer.apply_chat_template(probe, tokenize=False)
    after = tokenizer.apply_chat_template(probe + list(messages), add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ConfigError(f"the chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} does not "
                          f"render a chat as a prefix of a longer one, so an environment's messages cannot follow a "
                          f"sampled turn token for token; give the environment's replies as text instead")
    # the policy's own tokens end at its end-of-turn token: what the template writes after the
    # probe message up to and including that token belongs to the turn, not to the observation
    end = before.index(_PROBE) + len(_PROBE)
    eos = tokenizer.eos_token or ""
    if eos and before.startswith(eos, end):
        end += len(eos)
    return after[end:]
